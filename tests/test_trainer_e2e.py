"""The trainer end to end on a tiny model: eager/fused parity of one PPO update, checkpoint
resume, and a short smoke run of every algorithm through the command line (CI-sized)."""
import copy
import json
import os

import pytest
import torch

from ppo_kernels.trainer import Ops, TrainConfig
from ppo_kernels.trainer.algos import RLTrainer
from ppo_kernels.trainer.cli import main, run
from ppo_kernels.trainer.models import ValueModel, frozen_copy, tiny_model
from ppo_kernels.trainer.task import CharTokenizer, DecimalAdditionTask, Problem


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread is faster, and the CI machine's cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY = ["--vocab", "64", "--hidden", "32", "--layers", "1", "--heads", "2", "--sft-steps", "20", "--sft-batch", "16",
        "--eval-prompts", "8", "--prompts-per-step", "8", "--minibatch-size", "4",
        "--max-new-tokens", "36", "--no-progress", "--threads", "1"]


def _tiny_cfg(**kw):
    base = dict(vocab=64, hidden=32, layers=1, heads=2, sft_steps=0, prompts_per_step=8, minibatch_size=4,
                max_new_tokens=36, progress=False, plot=False, ent_coef=0.01)
    base.update(kw)
    return TrainConfig(**base).validate()


# Tolerance of the parity check: the fused ops accumulate in float32 like the eager code but in
# another order, so per-token values differ by ~1e-7; over two steps (2 epochs x 2 minibatches of
# AdamW each) metrics and parameters were measured within 1e-6 of each other here.
PARITY = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_eager_fused_parity_of_one_update(algo):
    """Same seed, same start: two rollout + update steps under each --ops give the same metrics."""
    tok, task = CharTokenizer(), DecimalAdditionTask()
    grpo = algo == "grpo"
    cfg = _tiny_cfg(algo=algo, group_size=4 if grpo else 1, prompts_per_step=4 if grpo else 8,
                    kl_coef=0.05)
    torch.manual_seed(0)
    actor0 = tiny_model(cfg, len(tok))
    critic0 = ValueModel.from_causal_lm(actor0) if algo == "ppo" else None
    if critic0 is not None:
        torch.nn.init.normal_(critic0.head.weight, std=0.1)
    problems = [Problem("0.10", "0.20"), Problem("1.25", "2.50"), Problem("0.10", "0.70"),
                Problem("3.33", "4.44"), Problem("9.99", "0.01"), Problem("0.05", "0.05"),
                Problem("2.20", "1.10"), Problem("7.00", "0.35")][:cfg.prompts_per_step]
    results = {}
    for mode in ("eager", "fused"):
        actor = copy.deepcopy(actor0)
        # reward mix: make sure advantages are non-zero even for an untrained model
        tr = RLTrainer(cfg, actor, frozen_copy(actor0), copy.deepcopy(critic0), tok, task, Ops(mode))
        tr.task = _PartialCredit()
        m1 = tr.step(problems)
        m2 = tr.step(problems)  # the second step runs with a moved policy (non-zero KL)
        results[mode] = (m1, m2, [p.detach().clone() for p in actor.parameters()])
    (e1, e2, ep), (f1, f2, fp) = results["eager"], results["fused"]
    for e, f in ((e1, f1), (e2, f2)):
        assert e.keys() == f.keys()
        for k in e:
            torch.testing.assert_close(torch.tensor(f[k]), torch.tensor(e[k]), **PARITY,
                                       msg=lambda m, k=k: f"metric {k}: {m}")
    assert e1["pg_loss"] != 0.0 and e2["kl"] != 0.0
    for a, b in zip(ep, fp):
        torch.testing.assert_close(b, a, **PARITY)


class _PartialCredit(DecimalAdditionTask):
    """Dense stand-in reward for an untrained model: the fraction of digits in the response."""

    def verify(self, problem, response):
        return sum(c.isdigit() for c in response) / max(1, len(response))


def test_checkpoint_resume_gives_the_same_continuation(tmp_path):
    args = dict(vocab=64, hidden=32, layers=1, heads=2, sft_steps=10, sft_batch=8, eval_prompts=4,
                prompts_per_step=8, minibatch_size=4, max_new_tokens=36, progress=False,
                plot=False, sft_cache=str(tmp_path / "sft"), threads=1)
    full = run(TrainConfig(**args, steps=3, out=str(tmp_path / "full")).validate(), log=lambda *a: None)
    run(TrainConfig(**args, steps=1, out=str(tmp_path / "part")).validate(), log=lambda *a: None)
    resumed = run(TrainConfig(**args, steps=3, out=str(tmp_path / "part"),
                              resume=str(tmp_path / "part")).validate(),
                  log=lambda *a: None)

    def rows(d):
        with open(tmp_path / d / "metrics.jsonl") as f:
            return [json.loads(x) for x in f]
    a, b = rows("full"), rows("part")
    assert [r["step"] for r in b] == [0, 1, 2]
    for ra, rb in zip(a, b):
        ra.pop("seconds"), rb.pop("seconds")
        assert ra == rb
    assert resumed["eval_reward_after"] == full["eval_reward_after"]
    ca = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)["trainer"]["actor"]
    cb = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)["trainer"]["actor"]
    for k in ca:
        torch.testing.assert_close(ca[k], cb[k], rtol=0, atol=0)


@pytest.mark.parametrize("algo, extra", [
    ("ppo", ["--steps", "2", "--ops", "fused"]),
    ("grpo", ["--steps", "1", "--group-size", "4", "--prompts-per-step", "2",
              "--group-advantage", "rloo"]),
    ("dpo", ["--steps", "2", "--pairs", "16", "--pref-batch", "8"]),
    ("rm", ["--steps", "2", "--pairs", "16", "--pref-batch", "8", "--eval-pairs", "8"]),
])
def test_cli_smoke(tmp_path, algo, extra):
    out = tmp_path / algo
    assert main(["--algo", algo, "--out", str(out), "--sft-cache", str(tmp_path / "sft"),
                 *TINY, *extra]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for k in ("eval_reward_before", "eval_reward_after", "seconds_per_step", "peak_memory_bytes"):
        assert summary[k] is not None, k
    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = int(extra[extra.index("--steps") + 1])
    assert len(lines) == steps and all(json.loads(x)["phase"] == algo for x in lines)
    assert (out / "curves.png").stat().st_size > 1000
    assert len((out / "metrics.csv").read_text().splitlines()) == steps + 1
    if algo == "rm":
        assert os.path.exists(out / "reward_model.pt")


def test_ppo_with_reward_model_and_critic_from_it(tmp_path):
    rm_out = tmp_path / "rm"
    common = ["--sft-cache", str(tmp_path / "sft"), *TINY]
    assert main(["--algo", "rm", "--out", str(rm_out), "--steps", "2", "--pairs", "16",
                 "--pref-batch", "8", "--eval-pairs", "8", *common]) == 0
    out = tmp_path / "ppo_rm"
    assert main(["--algo", "ppo", "--reward", "rm", "--rm-path", str(rm_out / "reward_model.pt"),
                 "--out", str(out), "--steps", "1", *common]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["config"]["reward"] == "rm"


def test_local_hf_model_path(tmp_path):
    """--model PATH: a transformers causal LM and tokenizer saved on disk (here a tiny Qwen2 with
    a character-level fast tokenizer), trained on the embedded task."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    chars = CharTokenizer().vocab[2:]  # "$" (the task's end marker) and the task's characters
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>")
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, tie_word_embeddings=False))
    path = tmp_path / "hf"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    out = tmp_path / "out"
    assert main(["--model", str(path), "--out", str(out), "--steps", "1", *TINY]) == 0
    assert json.loads((out / "summary.json").read_text())["eval_reward_after"] is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ops", ["fused", "eager"])
def test_cuda_smoke(tmp_path, ops):
    out = tmp_path / ops
    assert main(["--device", "cuda", "--ops", ops, "--out", str(out), "--steps", "2",
                 "--sft-cache", str(tmp_path / "sft"), *TINY]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["peak_memory_kind"] == "cuda_max_memory_allocated" and s["peak_memory_bytes"] > 0


def test_compare_prints_the_table_and_overlays_the_plot(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["--out", str(out), "--steps", "2", "--compare", "--sft-cache",
                 str(tmp_path / "sft"), *TINY]) == 0
    text = capsys.readouterr().out
    assert "fused/eager" in text and "peak tensor memory" in text, text
    assert text.rstrip().endswith(f"plot: {out / 'curves.png'}"), text
    assert (out / "compare.txt").read_text() in text
    for run_dir in (out, out / "compare_eager"):
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["peak_memory_bytes"] > 0 and s["seconds_per_step"] > 0
