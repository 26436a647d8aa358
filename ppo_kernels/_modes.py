"""Modes that cross the Python / C++ boundary, by name. The op schemas take these strings; the
position of a name in its table is the enum value the C++ kernels switch on (csrc/common/modes.h)
and the constexpr the Triton kernels specialise on. tests/package/test_contract.py checks these tables
against the C++ ones (`torch.ops.ppo_kernels_C.mode_names`)."""

from __future__ import annotations

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
KL_ESTIMATOR_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # verl's names
GROUP_ADVANTAGES = ("grpo", "rloo")
# policy-loss types whose per-token loss is ppo's clipped surrogate (policy_math.CLIP_TYPES)
CLIP_LOSS_TYPES = ("ppo", "grpo", "bnpo", "dr_grpo", "dapo", "luspo")

# table name in csrc/common/modes.h -> the Python table
TABLES = {
    "agg": AGG_MODES,
    "kl_estimator": KL_ESTIMATORS,
    "group_advantage": GROUP_ADVANTAGES,
    "clip_loss_type": CLIP_LOSS_TYPES,
}


def index(arg: str, table: tuple[str, ...], name: str) -> int:
    """Position of `name` in `table` (the kernels' enum value); a clear error naming `arg`."""
    try:
        return table.index(name)
    except ValueError:
        raise ValueError(f"{arg}: unknown mode {name!r}; expected one of {table}") from None
