"""What the trainer keeps on disk besides its metrics: the SFT cache, the resumable checkpoint,
the reward model.

- `DIR/sft_cache/sft_<key>.pt` (or `--sft-cache DIR`): the SFT-warmed Actor, keyed by what
  determines it, so a fused and an eager run (and a resume) start from the same one.
- `DIR/checkpoint.pt`: what `--resume DIR` needs to continue a PPO / GRPO run exactly -- the
  Actor, the frozen Reference, the Critic, both AdamW states (their moments shape every later
  update: without them the continuation differs), the KL coefficient, the sampling and shuffling
  generators, and the timings so far. One file, overwritten (written to a temporary name, then
  renamed): at the end of the run and every `--save-every` steps, never with `--no-checkpoint`.
- `DIR/reward_model.pt` (`--algo rm`, or PPO with `--reward rm` and no `--rm-path`).

A checkpoint is also a teacher (`--algo distill --teacher DIR`): `load_teacher` builds its Actor
from the configuration saved with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch

from .config import ConfigError, TrainConfig

CHECKPOINT = "checkpoint.pt"
# the summary entries a resumed run carries over (its "before" evaluation is not repeated)
CARRIED = ("eval_reward_before", "eval_tool_use_before")


def _sft_key(cfg: TrainConfig, vocab_size: int) -> str:
    keys = (
        "model",
        "arch",
        "hidden",
        "layers",
        "heads",
        "sft_steps",
        "sft_batch",
        "sft_lr",
        "p_tool",
        "p_format",
        "seed",
    )
    blob = json.dumps({"vocab": vocab_size, **{k: getattr(cfg, k) for k in keys}}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def sft_cache_path(cfg: TrainConfig, vocab_size: int) -> str:
    cache_dir = cfg.sft_cache or os.path.join(cfg.out, "sft_cache")
    return os.path.join(cache_dir, f"sft_{_sft_key(cfg, vocab_size)}.pt")


def save_atomic(obj, path: str):
    """torch.save to a temporary name, then renamed: a crash never leaves half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def save_value_model(vm, path):
    torch.save({"config": vm.body.config.to_dict(), "state_dict": vm.state_dict()}, path)


def load_value_model(path, device):
    from transformers import AutoConfig, AutoModel

    from .models import ValueModel

    blob = torch.load(path, map_location=device)
    conf = dict(blob["config"])
    conf_obj = AutoConfig.for_model(conf.pop("model_type"), **conf)
    vm = ValueModel(AutoModel.from_config(conf_obj), conf_obj.hidden_size)
    vm.load_state_dict(blob["state_dict"])
    return vm.to(device).eval()


def checkpoint_path(resume: str) -> str:
    """--resume takes the run directory (or the checkpoint file in it)."""
    path = os.path.join(resume, CHECKPOINT) if os.path.isdir(resume) else resume
    if not os.path.isfile(path):
        raise ConfigError(
            f"--resume: no checkpoint at {path!r} (pass the directory of a run that saved one; "
            "a run with --no-checkpoint saves none)"
        )
    return path


def load_checkpoint(resume: str, device: str) -> dict:
    return torch.load(checkpoint_path(resume), map_location=device, weights_only=False)


def save_checkpoint(
    path: str, cfg: TrainConfig, step: int, trainer_state: dict, timings: dict, summary: dict
):
    """`timings`: step_times, cpu_times, peak_memory_bytes (see job._Run)."""
    save_atomic(
        {
            "cfg": dataclasses.asdict(cfg),
            "step": step,
            "trainer": trainer_state,
            **timings,
            **{k: summary[k] for k in CARRIED},
        },
        path,
    )


def due(cfg: TrainConfig, step: int) -> bool:
    """Whether a checkpoint is written after step `step` (0-based)."""
    if not cfg.checkpoint:
        return False
    return step + 1 == cfg.steps or bool(cfg.save_every and (step + 1) % cfg.save_every == 0)


def load_teacher(path: str, device: str):
    """The Actor saved in a run's checkpoint (`--teacher`: the run directory or the file),
    rebuilt from the model flags saved with it, frozen, on `device`."""
    from .models import frozen_copy, load_actor

    file = os.path.join(path, CHECKPOINT) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConfigError(
            f"--teacher: no checkpoint at {file!r} (pass the directory of a run that saved one, "
            "e.g. --algo ppo --out DIR without --no-checkpoint)"
        )
    blob = torch.load(file, map_location=device, weights_only=False)
    trainer = blob.get("trainer") if isinstance(blob, dict) else None
    if not isinstance(trainer, dict) or "actor" not in trainer or "cfg" not in blob:
        raise ConfigError(
            f"--teacher: {file!r} holds no Actor (expected the checkpoint.pt of a --algo ppo / "
            "grpo run)"
        )
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    saved = TrainConfig(**{k: v for k, v in blob["cfg"].items() if k in names})
    # building the tiny model seeds torch's generator: keep the run's random stream as it is
    with torch.random.fork_rng(devices=[]):
        model, tok = load_actor(saved)
    model.load_state_dict(trainer["actor"])
    return frozen_copy(model.to(device)), len(tok)
