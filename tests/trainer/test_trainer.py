"""The thin trainer: task and verifier, rollout masks in the tool environment, prefix restriction,
reward placement, GAE over tool tokens, truncation bootstrap, config errors."""

import copy
import math
import random
import subprocess
import sys

import pytest
import torch
from support import ROOT
from support.skips import NO_GLIBC

from ppo_kernels.gae import naive as gae_ref
from ppo_kernels.trainer import ConfigError, Ops, TrainConfig
from ppo_kernels.trainer.algos.common import prompt_tokens
from ppo_kernels.trainer.algos.ppo import RLTrainer
from ppo_kernels.trainer.config import config_from_args
from ppo_kernels.trainer.models import (
    ValueModel,
    frozen_copy,
    last_index,
    lm_head,
    tiny_model,
)
from ppo_kernels.trainer.models import token_logprobs as model_logprobs
from ppo_kernels.trainer.rollout import generate
from ppo_kernels.trainer.task import (
    CharTokenizer,
    DecimalAdditionTask,
    Problem,
    calculator,
)

MODES = ["eager", "fused"]


def tiny_cfg(**kw):
    base = dict(
        vocab=64,
        hidden=32,
        layers=1,
        heads=2,
        sft_steps=0,
        prompts_per_step=4,
        minibatch_size=2,
        max_new_tokens=40,
        eval_prompts=4,
        progress=False,
        plot=False,
    )
    base.update(kw)
    return TrainConfig(**base).validate()


# ---------------------------------------------------------------------------------------------
# task
# ---------------------------------------------------------------------------------------------
def test_task_running_example():
    task = DecimalAdditionTask()
    p = Problem("0.10", "0.20")
    assert p.prompt == "0.10+0.20="
    assert p.answer == "0.30"
    assert calculator("0.10+0.20") == "0.30000000000000004"
    assert task.tool_response("{0.10+0.20}") == "0.30000000000000004|"
    assert task.tool_response("{0.10+0.20") is None
    resp = lambda kind: "".join(t for t, _ in task.segments(p, kind))
    assert resp("format") == "{0.10+0.20}0.30000000000000004|0.30$"
    assert task.verify(p, resp("format")) == 1.0
    assert task.verify(p, resp("copy")) == 0.0  # execution B: the float printed verbatim
    assert task.verify(p, resp("direct")) == 1.0
    assert task.verify(p, "0.30") == 0.0  # no end marker: truncated, no answer
    assert task.verify(p, "0.3$") == 0.0
    # the calculator's float rounds the right way when formatted (0.1 + 0.7 = 0.7999999999999999)
    q = Problem("0.10", "0.70")
    assert calculator("0.10+0.70") == "0.7999999999999999"
    assert task.verify(q, "".join(t for t, _ in task.segments(q, "format"))) == 1.0


def test_preference_pairs_prefer_the_right_answer():
    task = DecimalAdditionTask()
    rng = random.Random(0)
    for p in task.problems(50, seed=1):
        ch, rj = task.preference_pair(p, rng)
        assert task.verify(p, "".join(t for t, _ in ch)) == 1.0
        assert task.verify(p, "".join(t for t, _ in rj)) == 0.0


@pytest.mark.parametrize("coef", [0.0, 0.5])
def test_dpo_loss_adds_the_chosen_nll(coef):
    """Step 0 (policy = Reference, DPO term log 2): the logged loss is log 2 + coef x the chosen
    responses' per-token NLL, which is checked against the log-probs computed here."""
    from ppo_kernels.trainer.algos.common import pair_batch, preference_data
    from ppo_kernels.trainer.algos.dpo import train_dpo

    cfg = tiny_cfg(algo="dpo", steps=1, pairs=8, pref_batch=8, dpo_nll_coef=coef)
    tok, task = CharTokenizer(cfg.vocab), DecimalAdditionTask()
    torch.manual_seed(0)
    actor = tiny_model(cfg, len(tok))
    b = pair_batch(cfg, tok, *preference_data(cfg, tok, task, 8, cfg.seed + 10), 0, 8)
    with torch.no_grad():
        lp = model_logprobs(Ops("eager"), actor, *b.model_inputs())[:8]
    m = b.action_mask[:8]
    nll = -((lp * m).sum(1) / m.sum(1)).mean().item()
    logged = []
    train_dpo(cfg, actor, tok, task, Ops("fused"), on_step=lambda s, x: logged.append(x))
    assert logged[0]["chosen_nll"] == pytest.approx(nll, rel=1e-5)
    assert logged[0]["dpo_loss"] == pytest.approx(math.log(2) + coef * nll, rel=1e-5)


def test_reward_model_scores_are_standardised():
    """After training, the RM's head is rescaled: mean 0 and std 1 over the scored responses,
    the same preferences (an increasing affine map)."""
    from ppo_kernels.trainer.algos.common import pair_batch, preference_data
    from ppo_kernels.trainer.algos.rm import standardize_scores
    from ppo_kernels.trainer.models import score

    cfg = tiny_cfg(algo="rm")
    tok, task = CharTokenizer(cfg.vocab), DecimalAdditionTask()
    torch.manual_seed(0)
    rm = ValueModel.from_causal_lm(tiny_model(cfg, len(tok))).eval()
    torch.nn.init.normal_(rm.head.weight, std=3.0)
    rm.head.bias.data.fill_(2.0)
    problems, pairs = preference_data(cfg, tok, task, 70, 1)
    b = pair_batch(cfg, tok, problems, pairs, 0, 70)
    with torch.no_grad():
        before = score(rm, *b.model_inputs())
        standardize_scores(cfg, rm, tok, problems, pairs)
        after = score(rm, *b.model_inputs())
    assert after.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert after.std().item() == pytest.approx(1.0, rel=1e-4)
    assert torch.equal(*(s.chunk(2)[0] > s.chunk(2)[1] for s in (before, after)))


# ---------------------------------------------------------------------------------------------
# rollouts: a scripted "model" that writes a given response, so the masks can be checked exactly
# ---------------------------------------------------------------------------------------------
class ScriptedLM(torch.nn.Module):
    """Emits, for each row, the next character of a target response (actions and tool output;
    the environment forces the tool part, so only the action characters are really sampled)."""

    def __init__(self, tok, prompts, targets):
        super().__init__()
        self.tok, self.targets = tok, targets
        self.prompt_len = [len(p) for p in prompts]
        self.hist = [[] for _ in prompts]

    def forward(
        self, input_ids, attention_mask, position_ids=None, past_key_values=None, use_cache=False
    ):
        B, n = input_ids.shape
        am = attention_mask[:, -n:]
        logits = torch.full((B, n, len(self.tok)), -30.0)
        for i in range(B):
            self.hist[i] += [int(t) for t, a in zip(input_ids[i], am[i]) if a]
            done = len(self.hist[i]) - self.prompt_len[i]
            nxt = self.targets[i][done] if done < len(self.targets[i]) else "$"
            logits[i, -1, self.tok.index[nxt]] = 30.0

        class Out:
            pass

        out = Out()
        out.logits, out.past_key_values = logits, past_key_values
        return out


def _rollout(targets, max_new_tokens=40):
    tok, task = CharTokenizer(), DecimalAdditionTask()
    problems = [Problem("0.10", "0.20"), Problem("1.25", "2.50"), Problem("0.10", "0.70")][
        : len(targets)
    ]
    prompts = prompt_tokens(tok, problems)
    model = ScriptedLM(tok, prompts, targets)
    b = generate(
        model,
        tok,
        task,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    return tok, task, problems, b


def test_rollout_masks_tool_tokens():
    targets = ["{0.10+0.20}0.30000000000000004|0.30$", "3.75$"]
    tok, task, problems, b = _rollout(targets)
    assert b.responses == targets
    assert [task.verify(p, r) for p, r in zip(problems, b.responses)] == [1.0, 1.0]
    assert not b.truncated.any()
    P = len(prompt_tokens(tok, problems[:1])[0])  # prompts are the same length here
    for i, t in enumerate(targets):
        labels = b.input_ids[i, 1:]
        mask = b.action_mask[i]
        # prompt (with BOS) and padding: 0; the response positions: 1 for actions only
        assert mask[: P - 1].sum() == 0
        resp_mask = mask[P - 1 : P - 1 + len(t)]
        expected = [
            0 if (j >= t.find("}") + 1 and j <= t.find("|")) and "|" in t else 1
            for j in range(len(t))
        ]
        assert resp_mask.tolist() == expected
        assert tok.decode(labels[P - 1 : P - 1 + len(t)]) == t
        assert mask[P - 1 + len(t) :].sum() == 0
        assert b.attention_mask[i].sum() == P + len(t)


def test_rollout_truncation_flags():
    # the second row never writes the end marker; the third is cut inside the tool output
    targets = ["0.30$", "1.0000000000000000000", "{0.10+0.70}"]
    _, _, _, b = _rollout(targets, max_new_tokens=14)
    assert b.truncated.tolist() == [False, True, True]
    assert b.responses[2] == "{0.10+0.70}0.7"  # 14 tokens: 11 of action, 3 of tool output
    # the truncated tool output is still context (mask 0), the call itself is action
    assert b.action_mask[2].sum() == len("{0.10+0.70}")


# ---------------------------------------------------------------------------------------------
# models: every prediction restricted to its prefix
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_prefix_restriction(mode):
    cfg = tiny_cfg()
    tok = CharTokenizer()
    torch.manual_seed(0)
    actor = tiny_model(cfg, len(tok))
    critic = ValueModel.from_causal_lm(actor)
    torch.nn.init.normal_(critic.head.weight)
    _, _, _, b = _rollout(["{0.10+0.20}0.30000000000000004|0.30$", "3.75$"])
    ops = Ops(mode)
    with torch.no_grad():
        v = critic(*b.model_inputs())
        lp = model_logprobs(ops, actor, *b.model_inputs())
        for k in (5, 14, 30):
            cut = [x[:, :k] for x in b.model_inputs()]
            torch.testing.assert_close(critic(*cut), v[:, :k], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                model_logprobs(ops, actor, *cut), lp[:, : k - 1], atol=1e-5, rtol=1e-5
            )


def test_model_without_head_is_refused():
    from transformers import LlamaConfig, LlamaModel

    m = LlamaModel(
        LlamaConfig(
            vocab_size=20,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    with pytest.raises(ConfigError, match="no accessible LM head"):
        lm_head(m)


# ---------------------------------------------------------------------------------------------
# rewards and advantages
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_reward_placement_after_tool_tokens(mode):
    # actions, then tool output (mask 0), then actions, then padding
    mask = torch.tensor(
        [[0, 1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32
    )
    lp = torch.randn(2, 9) * 0.1
    ref = lp + torch.randn(2, 9) * 0.1
    scores = torch.tensor([2.0, -1.0])
    r, kl, mkl = Ops(mode).kl_penalized_rewards(scores, lp, ref, mask, beta=0.1, estimator="k1")
    d = (lp - ref) * mask
    expected = -0.1 * d
    expected[0, 6] += 2.0
    expected[1, 3] += -1.0
    torch.testing.assert_close(r, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kl, d, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(mkl, d.sum(1) / mask.sum(1), atol=1e-6, rtol=1e-6)


def _gae_by_hand(r, v, m, gamma, lam, boot):
    """Literal per-row recursion over the list of action positions (ppo-math.md)."""
    A = [0.0] * len(r)
    acts = [t for t in range(len(r)) if m[t]]
    a_next, v_next = 0.0, boot
    for t in reversed(acts):
        delta = r[t] + gamma * v_next - v[t]
        a_next = delta + gamma * lam * a_next
        v_next = v[t]
        A[t] = a_next
    carry = 0.0
    for t in reversed(range(len(r))):  # mask-0 positions carry the next action's advantage
        if m[t]:
            carry = A[t]
        else:
            A[t] = carry
    return A


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("boot", [0.0, 0.7])
def test_gae_skips_tool_tokens_and_bootstraps(mode, boot):
    torch.manual_seed(1)
    m = torch.tensor([[0, 1, 1, 0, 0, 0, 1, 1, 0, 0]], dtype=torch.float32)
    r = torch.randn(1, 10) * m
    v = torch.randn(1, 10) * m
    adv, ret = Ops(mode).gae(r, v, m, gamma=0.9, lam=0.8, bootstrap_value=torch.tensor([boot]))
    ref = torch.tensor([_gae_by_hand(r[0].tolist(), v[0].tolist(), m[0].tolist(), 0.9, 0.8, boot)])
    torch.testing.assert_close(adv, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, ref + v, atol=1e-5, rtol=1e-5)
    # tool tokens do not count as steps: same result as with them cut out
    keep = m[0] > 0
    adv_cut, _ = Ops(mode).gae(
        r[:, keep], v[:, keep], m[:, keep], gamma=0.9, lam=0.8, bootstrap_value=torch.tensor([boot])
    )
    torch.testing.assert_close(adv[:, keep], adv_cut, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_truncation_bootstraps_from_the_critic(mode):
    """A truncated row's last action sees V(final state); a terminated row sees 0."""
    cfg = tiny_cfg(whiten_advantages=False, kl_coef=0.0, gamma=0.9, lam=1.0)
    tok, task = CharTokenizer(), DecimalAdditionTask()
    torch.manual_seed(0)
    actor = tiny_model(cfg, len(tok))
    critic = ValueModel.from_causal_lm(actor)
    torch.nn.init.normal_(critic.head.weight, std=0.5)
    torch.nn.init.constant_(critic.head.bias, 0.3)
    tr = RLTrainer(cfg, actor, frozen_copy(actor), critic, tok, task, Ops(mode))
    _, _, _, b = _rollout(["0.30$", "1.00000000"], max_new_tokens=8)
    assert b.truncated.tolist() == [False, True]
    scores = torch.tensor([1.0, 0.0])
    d = tr.score_batch(b, scores)
    with torch.no_grad():
        v_all = critic(*b.model_inputs())
    last = last_index(b.attention_mask)
    torch.testing.assert_close(d["bootstrap"], torch.stack([torch.tensor(0.0), v_all[1, last[1]]]))
    for i, boot in ((0, 0.0), (1, v_all[1, last[1]].item())):
        t = int(last[i]) - 1  # the last action, in label-aligned columns
        expected = d["rewards"][i, t] + 0.9 * boot - d["values"][i, t]
        assert abs(d["advantages"][i, t].item() - expected.item()) < 1e-5
        assert d["rewards"][i, t].item() == scores[i].item()


# ---------------------------------------------------------------------------------------------
# eager implementations agree with the ops on the trainer's other per-token pieces
# ---------------------------------------------------------------------------------------------
def test_ops_modes_agree_on_losses():
    torch.manual_seed(0)
    B, T = 4, 12
    mask = (torch.rand(B, T) > 0.3).float()
    lp, old = torch.randn(B, T) * 0.2, torch.randn(B, T) * 0.2
    adv, v, ov, ret = (torch.randn(B, T) for _ in range(4))
    outs = {}
    for mode in MODES:
        o = Ops(mode)
        pl, pst = o.ppo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
        vl, vst = o.ppo_value_loss(v, ov, ret, mask, clip=0.2)
        outs[mode] = [
            pl,
            pst["clipfrac"],
            pst["approx_kl"],
            vl,
            vst["vf_clipfrac"],
            o.masked_whiten(adv, mask),
            o.masked_mean(adv, mask),
            o.grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2),
            o.rloo_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2),
            o.kl_penalty(lp, old, "k3"),
            o.reward_model_loss(adv[:, 0], adv[:, 1]),
            o.dpo_loss(adv[:, 0], adv[:, 1], adv[:, 2], adv[:, 3], beta=0.1),
        ]
    for a, b in zip(outs["eager"], outs["fused"]):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, match",
    [
        (["--algo", "grpo", "--group-size", "1"], "group-size.*>= 2"),
        (["--prompts-per-step", "10", "--minibatch-size", "4"], "not divisible into minibatches"),
        (["--algo", "dpo", "--pairs", "100", "--pref-batch", "32"], "pref-batch"),
        (["--device", "tpu"], "--device"),
        (["--lam", "1.5"], "--lam"),
        (["--hidden", "30", "--heads", "4"], "--hidden"),
        (["--dual-clip", "0.5"], "--dual-clip"),
    ],
)
def test_bad_configs_name_the_flag(argv, match):
    with pytest.raises(ConfigError, match=match):
        config_from_args(argv)


def test_cli_reports_bad_config(capsys):
    from ppo_kernels.trainer.cli import main

    assert main(["--algo", "grpo", "--group-size", "1", "--out", "/nonexistent"]) == 2
    assert "group-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--ops", "fast"])


def test_eager_gae_matches_literal_loop_batched():
    torch.manual_seed(3)
    m = (torch.rand(5, 17) > 0.4).float()
    r, v, boot = torch.randn(5, 17), torch.randn(5, 17), torch.randn(5)
    adv, _ = gae_ref.verl_gae_loop(r, v, m, 0.97, 0.9, boot)
    for i in range(5):
        ref = _gae_by_hand(r[i].tolist(), v[i].tolist(), m[i].tolist(), 0.97, 0.9, boot[i].item())
        torch.testing.assert_close(adv[i], torch.tensor(ref), atol=1e-5, rtol=1e-5)


def test_adaptive_kl_controller():
    from ppo_kernels.trainer.algos.ppo import AdaptiveKL

    c = AdaptiveKL(0.1, target=0.5, horizon=100, adaptive=True)
    c.update(1.0, 10)  # KL above target: beta grows, error clipped at +0.2
    assert c.beta == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    c.update(0.25, 10)  # below target: shrinks by 1 + (-0.5 -> -0.2) * 0.1
    assert c.beta == pytest.approx(0.1 * 1.02 * 0.98)
    fixed = AdaptiveKL(0.1, target=0.5, horizon=100, adaptive=False)
    fixed.update(5.0, 10)
    assert fixed.beta == 0.1


def test_fused_mode_reports_what_it_ran(monkeypatch):
    monkeypatch.setenv("PPO_TRAINER_EAGER_OPS", "gae")
    o = Ops("fused")
    m = torch.ones(1, 4)
    o.gae(torch.zeros(1, 4), torch.zeros(1, 4), m, gamma=1.0, lam=1.0)
    o.masked_mean(torch.ones(1, 4), m)
    assert "gae" in o.fallbacks and "masked_mean" in o.used
    e = Ops("eager")
    e.masked_mean(torch.ones(1, 4), m)
    assert not e.used and not e.fallbacks
    with pytest.raises(ValueError, match="ops"):
        Ops("fast")


def test_cli_without_transformers_is_one_line(monkeypatch, capsys, tmp_path):
    from ppo_kernels.trainer.cli import main

    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import fails
    assert main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'ppo-kernels[train]'" in err, err


def test_train_help_ends_with_three_examples(capsys):
    from ppo_kernels.trainer.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    tail = capsys.readouterr().out.strip().splitlines()[-3:]
    assert all(line.strip().startswith("python -m ppo_kernels train") for line in tail), tail


def test_resume_names_a_missing_checkpoint(tmp_path):
    from ppo_kernels.trainer.checkpoint import checkpoint_path

    with pytest.raises(ConfigError, match="--resume"):
        checkpoint_path(str(tmp_path))
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert checkpoint_path(str(tmp_path)) == str(tmp_path / "checkpoint.pt")


def test_eager_ops_materialise_the_logits_and_fused_do_not():
    """--ops eager is what trainers run today (the [N, V] logits and their float32 softmax), the
    tensor-peak measurement of --compare sees it, and the fused op stays far below it."""
    from ppo_kernels._memory import tensor_peak

    torch.manual_seed(0)
    N, H, V = 256, 16, 32000
    h = torch.randn(N, H, requires_grad=True)
    w = (torch.randn(V, H) / 4).requires_grad_()
    labels = torch.randint(0, V, (N,))
    labels[:7] = -100
    peaks, outs = {}, {}
    for mode in MODES:
        with tensor_peak("cpu") as peak:
            lp, ent = Ops(mode).logprobs_from_hidden(
                h, w, None, labels, temperature=0.7, return_entropy=True
            )
            (lp.sum() + ent.sum()).backward()
        peaks[mode], outs[mode] = peak.bytes, (lp, ent)
    logits_bytes = N * V * 4
    assert peaks["eager"] >= 2 * logits_bytes, peaks
    # (at this N one vocabulary tile of the fused op is the whole width: it holds ~ one logits)
    assert 4 * peaks["fused"] < peaks["eager"], peaks
    for a, b in zip(outs["eager"], outs["fused"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert (outs["eager"][0][:7] == 0).all() and (outs["eager"][1][:7] == 0).all()


# ---------------------------------------------------------------------------------------------
# the fused actor loss (linear_policy_loss) against today's fused composition
# ---------------------------------------------------------------------------------------------
class _DigitCredit(DecimalAdditionTask):
    """Dense stand-in reward for an untrained model (non-zero advantages)."""

    def verify(self, problem, response):
        return sum(c.isdigit() for c in response) / max(1, len(response))


@pytest.mark.parametrize("micro_batch", [0, 3])
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_fused_actor_loss_is_the_composition(monkeypatch, algo, micro_batch):
    """--ops fused computes the PPO / GRPO actor loss with linear_policy_loss from the last hidden
    states and the LM head (the logits once); one update gives the gradient, the metrics and the
    parameters of the composition it replaces (linear_token_logprobs, ppo_policy_loss, the
    entropy's masked_mean and for GRPO kl_penalty: PPO_TRAINER_EAGER_OPS=linear_policy_loss)
    within float32 tolerance, in one pass or in micro-batches."""
    grpo = algo == "grpo"
    cfg = tiny_cfg(
        algo=algo,
        group_size=2 if grpo else 1,
        prompts_per_step=4,
        minibatch_size=8 if grpo else 4,
        ppo_epochs=1,
        micro_batch=micro_batch,
        kl_coef=0.1,
        ent_coef=0.05,
        dual_clip=3.0,
        clip_high=0.28,
    )
    tok = CharTokenizer()
    torch.manual_seed(0)
    actor0 = tiny_model(cfg, len(tok))
    critic0 = None if grpo else ValueModel.from_causal_lm(actor0)
    problems = [Problem("0.10", "0.20"), Problem("1.25", "2.50"), Problem("3.33", "4.44")]
    problems.append(Problem("9.99", "0.01"))
    runs = {}
    for name, env in (("fused", ""), ("composed", "linear_policy_loss")):
        monkeypatch.setenv("PPO_TRAINER_EAGER_OPS", env)
        ops = Ops("fused")
        actor = copy.deepcopy(actor0)
        ref = frozen_copy(actor0)
        with torch.no_grad():  # a Reference that differs: a non-zero KL term
            for p in ref.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        tr = RLTrainer(cfg, actor, ref, copy.deepcopy(critic0), tok, _DigitCredit(), ops)
        m = tr.step(problems)
        grads = [p.grad.clone() for p in actor.parameters()]
        runs[name] = (m, grads, [p.detach().clone() for p in actor.parameters()], ops)
    (mf, gf, pf, of), (mc, gc, pc, oc) = runs["fused"], runs["composed"]
    assert "linear_policy_loss" in of.used and "linear_policy_loss" in oc.fallbacks
    assert mf.keys() == mc.keys() and mc["pg_loss"] != 0.0
    for k in mc:
        torch.testing.assert_close(
            torch.tensor(mf[k]), torch.tensor(mc[k]), rtol=1e-5, atol=1e-6, msg=k
        )
    for a, b in zip(gf, gc):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(pf, pc):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_keep_heap_flag_and_effect():
    """--keep-heap (default) / --no-keep-heap parse; on glibc the setting applies (mallopt), and a
    large block freed and allocated again costs no new page faults (it was not unmapped).
    Measured on malloc's own blocks, in a process that imported torch as the trainer does: torch's
    CPU tensors come from posix_memalign, whose large blocks glibc reuses only some of the time
    under these settings (the suite saw all four of a row fault in again), so they would make
    this check flaky, not stricter."""
    import platform

    from ppo_kernels.trainer import job

    assert config_from_args([])[0].keep_heap is True
    assert config_from_args(["--no-keep-heap"])[0].keep_heap is False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip(NO_GLIBC)
    assert job.keep_heap() is True
    # The effect in a fresh process: the heap this one holds depends on the tests before it (a
    # freed block that never reaches the top of the heap is faulted in again either way).
    code = """
import ctypes, resource, sys, torch
from ppo_kernels.trainer import job
if sys.argv[1] == "keep":
    assert job.keep_heap()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 64 * 2**20  # above glibc's largest mmap threshold

def faults_of_one_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)  # touch every page
    libc.free(ctypes.c_void_p(p))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(*[faults_of_one_block() for _ in range(4)])
"""

    def faults(mode):
        out = subprocess.run(
            [sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=300,
            cwd=ROOT,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return [int(x) for x in out.stdout.split()]

    pages = 64 * 2**20 // 4096
    # the first call grows the heap; then the block is reused. Without keep_heap() every call
    # maps it anew and faults in all 16384 pages (the check can fail)
    kept, plain = faults("keep"), faults("plain")
    assert max(kept[1:]) < pages // 4, kept
    assert min(plain) > pages // 2, plain
