"""Bad arguments to every registered op -- the public ops' custom-op layer (`torch.ops.ppo_kernels`,
backward ops included) and the raw kernels (`torch.ops.ppo_kernels_C`) -- must raise a Python
exception whose message names the argument: never a crash, an out-of-bounds read or garbage.

The calls run in a child process, so a segfault fails its test instead of the run. To stay fast
all cases share one child; if it dies, the cases it did not report run again one child each, and
the one that crashes fails."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from support.skips import unavailable

from ppo_kernels import _backend

PRELUDE = """
import json, sys, torch, ppo_kernels as pk
from ppo_kernels import _backend
ops = torch.ops.ppo_kernels
C = torch.ops.ppo_kernels_C if _backend.HAS_EXTENSION else None
inf = float("inf")
torch.manual_seed(0)
# token_logprobs / full_kl
logits = torch.randn(2, 3, 5)
labels = torch.randint(0, 5, (2, 3))
ref = torch.randn(2, 3, 5)
lp, ent, lse = torch.ops.ppo_kernels.token_logprobs(logits, labels, 1.0, -100, True, False)
g6 = torch.ones(2, 3)
big = torch.full((2, 3), 10**9)
kl, lz, lw = torch.ops.ppo_kernels.full_kl(logits, ref, 1.0, None)
# kl_penalty / kl_penalized_rewards / losses / gae: [B, T] = [2, 4]
a = torch.randn(2, 4)
b = torch.randn(2, 4)
m = torch.ones(2, 4, dtype=torch.bool)
sc = torch.randn(2)
loss, stats, coef = torch.ops.ppo_kernels.ppo_policy_loss(a, b, b, m, 0.2, 0.2, None, 20.0, 'token-mean',
                                                          1.0, None, None)
g0 = torch.ones(())
# linear_token_logprobs: hidden [3, 4], weight [5, 4]
h = torch.randn(3, 4)
w = torch.randn(5, 4)
lab3 = torch.randint(0, 5, (3,))
llp, lent, llse = ops.linear_token_logprobs(h, w, lab3, None, 1.0, -100, True, 0)
# linear_policy_loss: the op's arguments as the API builds them (hidden [8, 4], [B, T] = [2, 4])
from ppo_kernels.linear_policy_loss import api as lpl_api, op as lpl_op
lpl = list(lpl_api.arguments(torch.randn(2, 4, 4), w, torch.randint(0, 5, (2, 4)), a, b, m)[0])
lpl = lpl[: len(lpl_op.ARG_NAMES)]
def lpl_with(**kw):
    out = list(lpl)
    for k, v in kw.items():
        out[lpl_op.ARG_NAMES.index(k)] = v
    return out
# linear_policy_loss_sampler: the same, with top_k=3 (its arguments follow the plain op's)
lps = list(lpl_api.arguments(torch.randn(2, 4, 4), w, torch.randint(0, 5, (2, 4)), a, b, m,
                             top_k=3)[0])
lps = lps[: len(lpl_op.ARG_NAMES) + len(lpl_op.SAMPLER_NAMES)]
def lps_with(**kw):
    out = list(lps)
    for k, v in kw.items():
        out[(lpl_op.ARG_NAMES + lpl_op.SAMPLER_NAMES).index(k)] = v
    return out
# linear_preference_loss: one pair of rows of T = 4 tokens (hidden [8, 4]), as the API builds it
from ppo_kernels.linear_preference_loss import api as lpr_api, op as lpr_op
lpr = list(lpr_api.arguments(torch.randn(2, 4, 4), w, torch.randint(0, 5, (2, 4)), m)[0])
lpr = lpr[: len(lpr_op.ARG_NAMES)]
def lpr_with(**kw):
    out = list(lpr)
    for k, v in kw.items():
        out[lpr_op.ARG_NAMES.index(k)] = v
    return out
# linear_preference_loss_sampler: the same, with top_k=3 (its arguments follow the plain op's)
lprs = list(lpr_api.arguments(torch.randn(2, 4, 4), w, torch.randint(0, 5, (2, 4)), m,
                              top_k=3)[0])
lprs = lprs[: len(lpr_op.ARG_NAMES) + len(lpr_op.SAMPLER_NAMES)]
def lprs_with(**kw):
    out = list(lprs)
    for k, v in kw.items():
        out[(lpr_op.ARG_NAMES + lpr_op.SAMPLER_NAMES).index(k)] = v
    return out
# the vocab-parallel forms' ops (ppo_kernels.distributed) on one rank's states (world 1, no
# collective): logits [4, 6], hidden [4, 3], weight [6, 3]
import ppo_kernels.distributed
vz, vref, vy = torch.randn(4, 6), torch.randn(4, 6), torch.randint(0, 6, (4,))
vh, vw, g4 = torch.randn(4, 3), torch.randn(6, 3), torch.ones(4)
def vgathered(states):  # one rank's all-gather: (vocab_start, V_rank, N, given), then the states
    return torch.cat([torch.tensor([0.0, 6, 4, 0.0]), states.reshape(-1)]).view(1, -1)
vg = vgathered(ops.vocab_parallel_states(vz, vy, 0, 1.0, -100))
_, vent, vlse, vlayout = ops.vocab_parallel_token_logprobs(vz, vy, vg, 0, 1.0, -100, True)
vlg = vgathered(ops.vocab_parallel_linear_states(vh, vw, vy, None, 0, 1.0, -100, 0, "float32"))
_, vlent, vllse, vllayout = ops.vocab_parallel_linear_token_logprobs(
    vh, vw, vy, None, vlg, 0, 1.0, -100, True, 0, "float32", None)
vkl = torch.stack(ops.full_kl(vz, vref, 1.0, None)).reshape(1, -1)
# the sampler's vocab-parallel ops: the kept set of one rank (every option off)
vm, vit, vlmp = vz.amax(-1), torch.ones(4), torch.full((4,), float("-inf"))
vcut, vallow = torch.full((4,), -(2**63)), torch.full((4,), float("inf"), dtype=torch.float64)
vst = torch.tensor(0)
vsums = ops.vocab_parallel_sampler_states(vz, vy, vst, vm, vit, vlmp, vcut, vallow, -100)
vsg = torch.cat([torch.tensor([0.0, 6, 4, 0.0]), vm]).view(1, -1)
vsf = ops.vocab_parallel_sampler_finish(vz, vy, vsg, vsums, vm, vit, vlmp, vcut, vallow, 0, -100)
vmr = vref.amax(-1)
vkls = ops.vocab_parallel_sampler_kl_sums(vz, vref, vm, vmr, vit, vlmp, vcut, vallow)
vklo = ops.vocab_parallel_sampler_kl(vz, vref, vsums, vkls, vm, vmr, vit, vlmp, vcut, vallow, None)
# linear_distill_loss: hidden [3, 4], weight [5, 4], a teacher head [3, 2] / [5, 2]
from ppo_kernels.distill import op as ldl_op
ldl = [h, w, lab3, None, None, torch.randn(3, 2), torch.randn(5, 2), None, None, None, "jsd", 0.5,
       1.0, 0.5, 0.5, "bucket", -100, 0, "float32"]
def ldl_with(**kw):
    out = list(ldl)
    for k, v in kw.items():
        out[ldl_op.ARG_NAMES.index(k)] = v
    return out
# linear_distill_loss_sampler: the same, with top_k=3 (its arguments follow the plain op's)
lds = ldl + [None, 3, None, 1.0, None, 0.0, None, "vllm"]
def lds_with(**kw):
    out = list(lds)
    for k, v in kw.items():
        out[(ldl_op.ARG_NAMES + ldl_op.SAMPLER_NAMES).index(k)] = v
    return out
"""

# (id, needs the extension, backend or None, code, the argument the message must name)
CASES = [
    # --- token_logprobs: registered backward ops
    (
        "tlp_bwd_label_1e9",
        False,
        "each",
        "ops.token_logprobs_backward(g6, None, logits, big, lse, ent, 1.0, -100)",
        "labels",
    ),
    (
        "tlp_bwd_inplace_label_1e9",
        False,
        "each",
        "ops.token_logprobs_backward_(g6, None, logits.clone(), big, lse, ent, 1.0, -100)",
        "labels",
    ),
    (
        "tlp_bwd_grad_size",
        False,
        "each",
        "ops.token_logprobs_backward(g6[:1], None, logits, labels, lse, ent, 1.0, -100)",
        "grad_logprobs",
    ),
    (
        "tlp_bwd_lse_size",
        False,
        "each",
        "ops.token_logprobs_backward(g6, None, logits, labels, lse[:1], ent, 1.0, -100)",
        "lse",
    ),
    (
        "tlp_bwd_lse_dtype",
        False,
        "each",
        "ops.token_logprobs_backward(g6, None, logits, labels, lse.double(), ent, 1.0, -100)",
        "lse",
    ),
    (
        "tlp_bwd_entropy_size",
        False,
        "each",
        "ops.token_logprobs_backward(g6, g6, logits, labels, lse, ent[:1], 1.0, -100)",
        "entropy",
    ),
    (
        "tlp_bwd_grad_entropy_size",
        False,
        "each",
        "ops.token_logprobs_backward(g6, g6[:, :1], logits, labels, lse, ent, 1.0, -100)",
        "grad_entropy",
    ),
    (
        "tlp_bwd_temperature",
        False,
        "each",
        "ops.token_logprobs_backward(g6, None, logits, labels, lse, ent, 0.0, -100)",
        "temperature",
    ),
    (
        "tlp_fwd_label_shape",
        False,
        "each",
        "ops.token_logprobs(logits, labels[:1], 1.0, -100, False, False)",
        "labels",
    ),
    (
        "tlp_fwd_labels_float",
        False,
        "each",
        "ops.token_logprobs(logits, labels.float(), 1.0, -100, False, False)",
        "labels",
    ),
    (
        "tlp_fwd_label_1e9",
        False,
        "each",
        "ops.token_logprobs(logits, big, 1.0, -100, False, False)",
        "labels",
    ),
    (
        "tlp_public_temperature_str",
        False,
        None,
        "pk.token_logprobs(logits, labels, temperature='0.7')",
        "temperature",
    ),
    (
        "tlp_public_temperature_hot",
        False,
        None,
        "pk.token_logprobs(logits, labels, temperature='hot')",
        "temperature",
    ),
    (
        "tlp_public_temperature_tiny",
        False,
        None,
        "pk.token_logprobs(logits, labels, temperature=1e-40)",
        "temperature",
    ),
    (
        "tlp_public_entropy_flag",
        False,
        None,
        "pk.token_logprobs(logits, labels, return_entropy='yes')",
        "return_entropy",
    ),
    # --- token_logprobs: raw kernels
    (
        "C_tlp_bwd_label_1e9",
        True,
        None,
        "C.token_logprobs_bwd(g6, None, logits, big, lse, ent, 1.0, -100, torch.empty_like(logits))",
        "labels",
    ),
    (
        "C_tlp_bwd_label_negative",
        True,
        None,
        "C.token_logprobs_bwd(g6, None, logits, -labels - 1, lse, ent, 1.0, -100, torch.empty_like(logits))",
        "labels",
    ),
    (
        "C_tlp_bwd_lse_size",
        True,
        None,
        "C.token_logprobs_bwd(g6, None, logits, labels, lse[:1], ent, 1.0, -100, torch.empty_like(logits))",
        "lse",
    ),
    (
        "C_tlp_bwd_grad_size",
        True,
        None,
        "C.token_logprobs_bwd(g6[:1], None, logits, labels, lse, ent, 1.0, -100, torch.empty_like(logits))",
        "grad_logprobs",
    ),
    (
        "C_tlp_bwd_entropy_size",
        True,
        None,
        "C.token_logprobs_bwd(g6, g6, logits, labels, lse, ent[:1], 1.0, -100, torch.empty_like(logits))",
        "entropy",
    ),
    (
        "C_tlp_bwd_out_shape",
        True,
        None,
        "C.token_logprobs_bwd(g6, None, logits, labels, lse, ent, 1.0, -100, torch.empty(2, 5))",
        "grad_logits",
    ),
    (
        "C_tlp_bwd_out_dtype",
        True,
        None,
        "C.token_logprobs_bwd(g6, None, logits, labels, lse, ent, 1.0, -100, torch.empty_like(logits).half())",
        "grad_logits",
    ),
    (
        "C_tlp_bwd_labels_dtype",
        True,
        None,
        "C.token_logprobs_bwd(g6, None, logits, labels.float(), lse, ent, 1.0, -100, torch.empty_like(logits))",
        "labels",
    ),
    (
        "C_tlp_fwd_labels_size",
        True,
        None,
        "C.token_logprobs_fwd(logits, labels[:1], 1.0, -100, False)",
        "labels",
    ),
    (
        "C_tlp_fwd_logits_dtype",
        True,
        None,
        "C.token_logprobs_fwd(logits.long(), labels, 1.0, -100, False)",
        "logits",
    ),
    (
        "C_tlp_fwd_inv_t_inf",
        True,
        None,
        "C.token_logprobs_fwd(logits, labels, inf, -100, False)",
        "inv_temperature",
    ),
    # --- full_kl
    (
        "fkl_bwd_grad_size",
        False,
        "each",
        "ops.full_kl_backward(g6[:1], logits, ref, None, kl, lz, lw, 1.0, True)",
        "grad",
    ),
    (
        "fkl_bwd_kl_size",
        False,
        "each",
        "ops.full_kl_backward(g6, logits, ref, None, kl[:1], lz, lw, 1.0, True)",
        "kl",
    ),
    (
        "fkl_bwd_lse_z_size",
        False,
        "each",
        "ops.full_kl_backward(g6, logits, ref, None, kl, lz[:, :1], lw, 1.0, True)",
        "lse_z",
    ),
    (
        "fkl_bwd_lse_w_dtype",
        False,
        "each",
        "ops.full_kl_backward(g6, logits, ref, None, kl, lz, lw.double(), 1.0, True)",
        "lse_w",
    ),
    (
        "fkl_bwd_mask_size",
        False,
        "each",
        "ops.full_kl_backward(g6, logits, ref, m, kl, lz, lw, 1.0, True)",
        "mask",
    ),
    ("fkl_fwd_ref_shape", False, "each", "ops.full_kl(logits, ref[:1], 1.0, None)", "ref_logits"),
    (
        "C_fkl_bwd_out_shape",
        True,
        None,
        "C.full_kl_bwd(g6, logits, ref, None, kl, lz, lw, 1.0, torch.empty(2, 5), None)",
        "grad_logits",
    ),
    (
        "C_fkl_bwd_ref_out_shape",
        True,
        None,
        "C.full_kl_bwd(g6, logits, ref, None, kl, lz, lw, 1.0, torch.empty_like(logits), torch.empty(3))",
        "grad_ref_logits",
    ),
    (
        "C_fkl_bwd_lse_w_size",
        True,
        None,
        "C.full_kl_bwd(g6, logits, ref, None, kl, lz, lw[:1], 1.0, torch.empty_like(logits), None)",
        "lse_w",
    ),
    (
        "C_fkl_bwd_grad_size",
        True,
        None,
        "C.full_kl_bwd(g6[:1], logits, ref, None, kl, lz, lw, 1.0, torch.empty_like(logits), None)",
        "grad",
    ),
    (
        "C_fkl_fwd_mask_size",
        True,
        None,
        "C.full_kl_fwd(logits, ref, torch.ones(5, dtype=torch.bool), 1.0)",
        "mask",
    ),
    (
        "C_fkl_fwd_ref_dtype",
        True,
        None,
        "C.full_kl_fwd(logits, ref.half(), None, 1.0)",
        "ref_logits",
    ),
    ("C_fkl_fwd_inv_t", True, None, "C.full_kl_fwd(logits, ref, None, -1.0)", "inv_temperature"),
    # --- kl_penalty / kl_penalized_rewards
    (
        "kl_bwd_grad_size",
        False,
        "each",
        "ops.kl_penalty_backward(a[:1], a, b, 'k1', False, -inf, inf, -inf, inf, True, True)",
        "grad",
    ),
    (
        "kl_bwd_ref_shape",
        False,
        "each",
        "ops.kl_penalty_backward(a, a, b[:1], 'k1', False, -inf, inf, -inf, inf, True, True)",
        "ref_logprobs",
    ),
    (
        "kl_fwd_estimator",
        False,
        "each",
        "ops.kl_penalty(a, b, 'k7', False, -inf, inf, -inf, inf)",
        "estimator",
    ),
    (
        "kl_rewards_scores",
        False,
        "each",
        "ops.kl_penalized_rewards(sc[:1], a, b, m, None, 0.1, 'k1', -inf, inf, -inf, inf)",
        "scores",
    ),
    (
        "kl_rewards_mask",
        False,
        "each",
        "ops.kl_penalized_rewards(sc, a, b, m[:1], None, 0.1, 'k1', -inf, inf, -inf, inf)",
        "mask",
    ),
    (
        "kl_rewards_beta_t",
        False,
        "each",
        "ops.kl_penalized_rewards(sc, a, b, m, torch.ones(3), 0.1, 'k1', -inf, inf, -inf, inf)",
        "beta",
    ),
    (
        "kl_public_beta_nan",
        False,
        None,
        "pk.kl_penalized_rewards(sc, a, b, m, beta=float('nan'))",
        "beta",
    ),
    ("kl_public_beta_str", False, None, "pk.kl_penalized_rewards(sc, a, b, m, beta='0.1')", "beta"),
    (
        "C_kl_bwd_grad_size",
        True,
        None,
        "C.kl_penalty_bwd(a[:1], a, b, 'k1', False, -inf, inf, -inf, inf, True, True)",
        "grad",
    ),
    (
        "C_kl_fwd_ref_size",
        True,
        None,
        "C.kl_penalty_fwd(a, b[:1], 'k1', False, -inf, inf, -inf, inf)",
        "ref_logprobs",
    ),
    (
        "C_kl_fwd_estimator",
        True,
        None,
        "C.kl_penalty_fwd(a, b, 'k9', False, -inf, inf, -inf, inf)",
        "estimator",
    ),
    (
        "C_kl_rewards_scores",
        True,
        None,
        "C.kl_rewards_fwd(sc[:1], a, b, m, None, 0.1, 'k1', -inf, inf, -inf, inf)",
        "scores",
    ),
    (
        "C_kl_rewards_beta",
        True,
        None,
        "C.kl_rewards_fwd(sc, a, b, m, torch.ones(3), 0.1, 'k1', -inf, inf, -inf, inf)",
        "beta",
    ),
    (
        "C_kl_fwd_dtype",
        True,
        None,
        "C.kl_penalty_fwd(a.long(), b.long(), 'k1', False, -inf, inf, -inf, inf)",
        "logprobs",
    ),
    # --- PPO losses
    (
        "pol_bwd_row_coef",
        False,
        "each",
        "ops.ppo_policy_loss_backward(g0, a, b, b, m, coef[:1], 0.2, 0.2, None, 20.0)",
        "row_coef",
    ),
    (
        "pol_bwd_grad_loss",
        False,
        "each",
        "ops.ppo_policy_loss_backward(torch.ones(2), a, b, b, m, coef, 0.2, 0.2, None, 20.0)",
        "grad_loss",
    ),
    (
        "pol_bwd_mask",
        False,
        "each",
        "ops.ppo_policy_loss_backward(g0, a, b, b, m[:1], coef, 0.2, 0.2, None, 20.0)",
        "mask",
    ),
    (
        "pol_fwd_agg",
        False,
        "each",
        "ops.ppo_policy_loss(a, b, b, m, 0.2, 0.2, None, 20.0, 'mean', 1.0, None, None)",
        "agg",
    ),
    (
        "val_bwd_row_coef",
        False,
        "each",
        "ops.ppo_value_loss_backward(g0, a, b, b, m, coef[:1], None)",
        "row_coef",
    ),
    (
        "val_bwd_returns",
        False,
        "each",
        "ops.ppo_value_loss_backward(g0, a, b, b[:, :1], m, coef, None)",
        "returns",
    ),
    (
        "C_pol_bwd_row_coef",
        True,
        None,
        "C.ppo_policy_loss_bwd(g0, a, b, b, m, coef[:1], 0.2, 0.2, None, 20.0)",
        "row_coef",
    ),
    (
        "C_pol_bwd_grad_loss",
        True,
        None,
        "C.ppo_policy_loss_bwd(torch.ones(0), a, b, b, m, coef, 0.2, 0.2, None, 20.0)",
        "grad_loss",
    ),
    (
        "C_pol_fwd_old",
        True,
        None,
        "C.ppo_policy_loss_fwd(a, b[:1], b, m, 0.2, 0.2, None, 20.0, 'token-mean', 1.0, None, None)",
        "old_logprobs",
    ),
    (
        "C_pol_fwd_agg",
        True,
        None,
        "C.ppo_policy_loss_fwd(a, b, b, m, 0.2, 0.2, None, 20.0, 'mean', 1.0, None, None)",
        "agg",
    ),
    (
        "C_pol_fwd_global_denom",
        True,
        None,
        "C.ppo_policy_loss_fwd(a, b, b, m, 0.2, 0.2, None, 20.0, 'token-mean', 1.0, torch.ones(2), None)",
        "global_denom",
    ),
    (
        "C_val_bwd_returns",
        True,
        None,
        "C.ppo_value_loss_bwd(g0, a, b, b[:, :1], m, coef, None)",
        "returns",
    ),
    # --- masked_aggregate
    (
        "agg_op_mask_shape",
        False,
        "each",
        "ops.masked_aggregate(a, m[:, :2], 'token-mean', 1.0, None, None)",
        "mask",
    ),
    (
        "agg_op_loss_mat_int",
        False,
        "each",
        "ops.masked_aggregate(m.long(), m, 'token-mean', 1.0, None, None)",
        "loss_mat",
    ),
    ("agg_op_agg", False, "each", "ops.masked_aggregate(a, m, 'mean', 1.0, None, None)", "agg"),
    (
        "agg_op_global_denom",
        False,
        "each",
        "ops.masked_aggregate(a, m, 'token-mean', 1.0, torch.ones(2), None)",
        "global_denom",
    ),
    (
        "agg_bwd_row_coef",
        False,
        "each",
        "ops.masked_aggregate_backward(g0, m, coef[:1], torch.float32)",
        "row_coef",
    ),
    (
        "agg_bwd_grad_loss",
        False,
        "each",
        "ops.masked_aggregate_backward(torch.ones(2), m, coef, torch.float32)",
        "grad_loss",
    ),
    (
        "agg_bwd_dtype",
        False,
        "each",
        "ops.masked_aggregate_backward(g0, m, coef, torch.int64)",
        "dtype",
    ),
    (
        "C_agg_fwd_mask",
        True,
        None,
        "C.masked_aggregate_fwd(a, m[:1], 'token-mean', 1.0, None, None)",
        "mask",
    ),
    (
        "C_agg_bwd_row_coef",
        True,
        None,
        "C.masked_aggregate_bwd(g0, m, coef[:1], torch.float32)",
        "row_coef",
    ),
    ("agg_public_loss_mat_list", False, None, "pk.masked_aggregate([1.0], m)", "loss_mat"),
    # --- pairwise_logsigmoid_loss (reward_model_loss / dpo_loss)
    (
        "pair_op_rejected_shape",
        False,
        "each",
        "ops.pairwise_logsigmoid_loss(sc, sc[:1], None, None, 1.0, 'mean')",
        "rejected",
    ),
    (
        "pair_op_chosen_int",
        False,
        "each",
        "ops.pairwise_logsigmoid_loss(sc.long(), sc, None, None, 1.0, 'mean')",
        "chosen",
    ),
    (
        "pair_op_one_ref",
        False,
        "each",
        "ops.pairwise_logsigmoid_loss(sc, sc, sc, None, 1.0, 'mean')",
        "ref_chosen",
    ),
    (
        "pair_op_ref_shape",
        False,
        "each",
        "ops.pairwise_logsigmoid_loss(sc, sc, sc, sc[:1], 1.0, 'mean')",
        "ref_rejected",
    ),
    (
        "pair_op_beta",
        False,
        "each",
        "ops.pairwise_logsigmoid_loss(sc, sc, None, None, -1.0, 'mean')",
        "beta",
    ),
    (
        "pair_op_reduction",
        False,
        "each",
        "ops.pairwise_logsigmoid_loss(sc, sc, None, None, 1.0, 'avg')",
        "reduction",
    ),
    (
        "pair_bwd_grad_loss",
        False,
        "each",
        "ops.pairwise_logsigmoid_loss_backward(torch.ones(3), sc, 1.0, torch.float32, torch.float32)",
        "grad_loss",
    ),
    (
        "pair_bwd_dtype",
        False,
        "each",
        "ops.pairwise_logsigmoid_loss_backward(g0, sc, 1.0, torch.int64, torch.float32)",
        "dtype",
    ),
    (
        "C_pair_fwd_rejected",
        True,
        None,
        "C.pairwise_logsigmoid_loss_fwd(sc, sc[:1], None, None, 1.0, 'mean')",
        "rejected",
    ),
    (
        "C_pair_fwd_reduction",
        True,
        None,
        "C.pairwise_logsigmoid_loss_fwd(sc, sc, None, None, 1.0, 'avg')",
        "reduction",
    ),
    (
        "C_pair_bwd_coef",
        True,
        None,
        "C.pairwise_logsigmoid_loss_bwd(g0, sc.double(), 1.0, torch.float32, torch.float32)",
        "coef",
    ),
    (
        "C_pair_bwd_grad_loss",
        True,
        None,
        "C.pairwise_logsigmoid_loss_bwd(torch.ones(3), sc, 1.0, torch.float32, torch.float32)",
        "grad_loss",
    ),
    ("pair_public_beta_nan", False, None, "pk.dpo_loss(sc, sc, sc, sc, beta=float('nan'))", "beta"),
    (
        "ppo_public_dp_size_bool",
        False,
        None,
        "pk.ppo_policy_loss(a, b, b, m, dp_size=True)",
        "dp_size",
    ),
    ("ppo_public_clip_str", False, None, "pk.ppo_value_loss(a, b, b, m, clip='0.2')", "clip"),
    # --- group advantages
    (
        "grpo_public_index_1e9",
        False,
        None,
        "pk.grpo_advantages(sc, torch.full((2,), 10**9))",
        "group_index",
    ),
    ("grpo_public_eps_str", False, None, "pk.grpo_advantages(sc, group_size=2, eps='0')", "eps"),
    (
        "grpo_op_index_1e9",
        False,
        "each",
        "ops.group_advantages(sc, torch.full((2,), 10**9), 0, 1e-6, True, 'grpo', None)",
        "group_index",
    ),
    (
        "grpo_op_kind",
        False,
        "each",
        "ops.group_advantages(sc, None, 1, 1e-6, True, 'ppo', None)",
        "kind",
    ),
    (
        "grpo_op_mask_rows",
        False,
        "each",
        "ops.group_advantages(sc, None, 1, 1e-6, True, 'grpo', torch.ones(3, 4))",
        "mask",
    ),
    (
        "C_grpo_index_1e9",
        True,
        None,
        "C.group_advantages(sc, torch.full((2,), 10**9), 0, 1e-6, True, 'grpo', None)",
        "group_index",
    ),
    (
        "C_grpo_group_size",
        True,
        None,
        "C.group_advantages(sc, None, 0, 1e-6, True, 'grpo', None)",
        "group_size",
    ),
    (
        "C_grpo_mask_rows",
        True,
        None,
        "C.group_advantages(sc, None, 1, 1e-6, True, 'grpo', torch.ones(3, 4))",
        "mask",
    ),
    ("C_grpo_kind", True, None, "C.group_advantages(sc, None, 1, 1e-6, True, 'ppo', None)", "kind"),
    (
        "grpo_op_eps",
        False,
        "each",
        "ops.group_advantages(sc, None, 1, -1.0, True, 'grpo', None)",
        "eps",
    ),
    # --- gae
    (
        "gae_op_values_shape",
        False,
        "each",
        "ops.gae(a, b[:1], None, None, None, None, 1.0, 1.0, None, None, None)",
        "values",
    ),
    (
        "gae_op_gamma_alone",
        False,
        "each",
        "ops.gae(a, b, None, None, torch.ones(2, 4), None, 1.0, 1.0, None, None, None)",
        "lam_t",
    ),
    (
        "gae_op_init_value",
        False,
        "each",
        "ops.gae(a, b, None, None, None, None, 1.0, 1.0, torch.zeros(5), None, None)",
        "init_value",
    ),
    (
        "gae_op_cu_seqlens",
        False,
        "each",
        "ops.gae(a.view(-1), b.view(-1), None, None, None, None, 1.0, 1.0, None, None, torch.tensor([0, 9], dtype=torch.int32))",
        "cu_seqlens",
    ),
    (
        "gae_public_bootstrap_float",
        False,
        None,
        "pk.gae(a, b, bootstrap_value=1.0)",
        "bootstrap_value",
    ),
    ("gae_public_gamma_str", False, None, "pk.gae(a, b, gamma='0.9')", "gamma"),
    (
        "gae_op_mask_dtype",
        False,
        "each",
        "ops.gae(a, b, m.to(torch.complex64), None, None, None, 1.0, 1.0, None, None, None)",
        "mask",
    ),
    (
        "gae_op_cu_seqlens_dtype",
        False,
        "each",
        "ops.gae(a.view(-1), b.view(-1), None, None, None, None, 1.0, 1.0, None, None, torch.tensor([0.0, 8.0]))",
        "cu_seqlens",
    ),
    (
        "C_gae_values_size",
        True,
        None,
        "C.gae_fwd(a.view(-1), b.view(-1)[:3], None, None, None, None, 1.0, 1.0, None, None, None, 2, 4)",
        "values",
    ),
    (
        "C_gae_n_rows",
        True,
        None,
        "C.gae_fwd(a.view(-1), b.view(-1), None, None, None, None, 1.0, 1.0, None, None, None, -1, -8)",
        "n_rows",
    ),
    (
        "C_gae_row_len",
        True,
        None,
        "C.gae_fwd(a.view(-1), b.view(-1), None, None, None, None, 1.0, 1.0, None, None, None, 2, 5)",
        "row_len",
    ),
    (
        "C_gae_gamma_alone",
        True,
        None,
        "C.gae_fwd(a.view(-1), b.view(-1), None, None, torch.ones(8), None, 1.0, 1.0, None, None, None, 2, 4)",
        "lam_t",
    ),
    (
        "C_gae_init_value",
        True,
        None,
        "C.gae_fwd(a.view(-1), b.view(-1), None, None, None, None, 1.0, 1.0, torch.zeros(3), None, None, 2, 4)",
        "init_value",
    ),
    (
        "C_gae_cu_seqlens",
        True,
        None,
        "C.gae_fwd(a.view(-1), b.view(-1), None, None, None, None, 1.0, 1.0, None, None, torch.tensor([0, 3, 99], dtype=torch.int32), 2, -1)",
        "cu_seqlens",
    ),
    (
        "C_gae_rewards_dtype",
        True,
        None,
        "C.gae_fwd(a.view(-1).long(), b.view(-1).long(), None, None, None, None, 1.0, 1.0, None, None, None, 2, 4)",
        "rewards",
    ),
    # --- linear_policy_loss (the op and its gradients' op)
    (
        "lpl_labels_dtype",
        False,
        "each",
        "ops.linear_policy_loss(*lpl_with(labels=lpl[2].float()))",
        "labels",
    ),
    ("lpl_mask_shape", False, "each", "ops.linear_policy_loss(*lpl_with(mask=m[:, :2]))", "mask"),
    ("lpl_kl_coef", False, "each", "ops.linear_policy_loss(*lpl_with(kl_coef=inf))", "kl_coef"),
    ("lpl_z_loss", False, "each", "ops.linear_policy_loss(*lpl_with(z_loss=-1.0))", "z_loss"),
    (
        "lps_z_loss",
        False,
        "each",
        "ops.linear_policy_loss_sampler(*lps_with(z_loss=-0.1))",
        "z_loss",
    ),
    (
        "lpl_grads_weight_dtype",
        False,
        "each",
        "ops.linear_policy_loss_grads(*lpl_with(weight=w.double()), True, True, False)",
        "weight",
    ),
    (
        "lpl_grads_old_shape",
        False,
        "each",
        "ops.linear_policy_loss_grads(*lpl_with(old_logprobs=b[:1]), True, True, False)",
        "old_logprobs",
    ),
    # --- linear_policy_loss_sampler (the op and its gradients' op)
    (
        "lps_top_ks_negative",
        False,
        "each",
        "ops.linear_policy_loss_sampler(*lps_with(top_ks=torch.tensor([1, -1])))",
        "top_k",
    ),
    (
        "lps_temperatures_shape",
        False,
        "each",
        "ops.linear_policy_loss_sampler(*lps_with(temperatures=torch.ones(3)))",
        "temperature",
    ),
    (
        "lps_labels_1e9",
        False,
        "each",
        "ops.linear_policy_loss_sampler(*lps_with(labels=torch.full((2, 4), 10**9)))",
        "labels",
    ),
    (
        "lps_grads_ref_head",
        False,
        "each",
        "ops.linear_policy_loss_sampler_grads(*lps_with(ref_hidden=torch.ones(8, 2), ref_weight=torch.ones(5, 2)), True, True, False)",
        "ref_hidden",
    ),
    (
        "lps_grads_budget_below_a_row",
        False,
        "each",
        "ops.linear_policy_loss_sampler_grads(*lps_with(max_chunk_bytes=8), True, True, False)",
        "max_chunk_bytes",
    ),
    (
        "lps_grads_sampler_name",
        False,
        "each",
        "ops.linear_policy_loss_sampler_grads(*lps_with(sampler='hf'), True, True, False)",
        "sampler",
    ),
    # --- linear_preference_loss (the op and its gradients' op)
    (
        "lpr_labels_dtype",
        False,
        "each",
        "ops.linear_preference_loss(*lpr_with(labels=lpr[2].float()))",
        "labels",
    ),
    (
        "lpr_labels_1e9",
        False,
        "each",
        "ops.linear_preference_loss(*lpr_with(labels=torch.full((2, 4), 10**9)))",
        "labels",
    ),
    (
        "lpr_mask_shape",
        False,
        "each",
        "ops.linear_preference_loss(*lpr_with(mask=m[:, :2]))",
        "mask",
    ),
    (
        "lpr_pairs_shape",
        False,
        "each",
        "ops.linear_preference_loss(*lpr_with(pairs=torch.zeros(3, 2, dtype=torch.long)))",
        "pairs",
    ),
    (
        "lpr_pairs_1e9",
        False,
        "each",
        "ops.linear_preference_loss(*lpr_with(pairs=torch.tensor([[0, 10**9]])))",
        "pairs",
    ),
    (
        "lpr_desirable_paired",
        False,
        "each",
        "ops.linear_preference_loss(*lpr_with(desirable=torch.ones(2, dtype=torch.bool)))",
        "desirable",
    ),
    ("lpr_beta", False, "each", "ops.linear_preference_loss(*lpr_with(beta=-inf))", "beta"),
    (
        "lpr_grads_weight_dtype",
        False,
        "each",
        "ops.linear_preference_loss_grads(*lpr_with(weight=w.double()), True, True, False)",
        "weight",
    ),
    (
        "lpr_grads_ref_logps_shape",
        False,
        "each",
        "ops.linear_preference_loss_grads(*lpr_with(ref_logps=sc[:1]), True, True, False)",
        "ref_logps",
    ),
    # --- linear_preference_loss_sampler (the op and its gradients' op)
    (
        "lprs_top_ks_negative",
        False,
        "each",
        "ops.linear_preference_loss_sampler(*lprs_with(top_ks=torch.tensor([1, -1])))",
        "top_k",
    ),
    (
        "lprs_top_p_zero",
        False,
        "each",
        "ops.linear_preference_loss_sampler(*lprs_with(top_p=0.0))",
        "top_p",
    ),
    (
        "lprs_temperatures_shape",
        False,
        "each",
        "ops.linear_preference_loss_sampler(*lprs_with(temperatures=torch.ones(3)))",
        "temperature",
    ),
    (
        "lprs_temperatures_zero",
        False,
        "each",
        "ops.linear_preference_loss_sampler(*lprs_with(temperatures=torch.zeros(2)))",
        "temperature",
    ),
    (
        "lprs_labels_1e9",
        False,
        "each",
        "ops.linear_preference_loss_sampler(*lprs_with(labels=torch.full((2, 4), 10**9)))",
        "labels",
    ),
    (
        "lprs_grads_budget_below_a_row",
        False,
        "each",
        "ops.linear_preference_loss_sampler_grads(*lprs_with(max_chunk_bytes=8), True, True, False)",
        "max_chunk_bytes",
    ),
    (
        "lprs_grads_sampler_name",
        False,
        "each",
        "ops.linear_preference_loss_sampler_grads(*lprs_with(sampler='hf'), True, True, False)",
        "sampler",
    ),
    # --- masked statistics
    ("whiten_eps_str", False, None, "pk.masked_whiten(a, m, eps='1e-8')", "eps"),
    (
        "whiten_op_mask_shape",
        False,
        "each",
        "ops.masked_whiten(a, m[:, :2], True, True, 1e-8)",
        "mask",
    ),
    ("whiten_op_eps", False, "each", "ops.masked_whiten(a, m, True, True, -1.0)", "eps"),
    (
        "whiten_bwd_grad_shape",
        False,
        "each",
        "ops.masked_whiten_backward(a[:1], a, m, True, True, 1e-8)",
        "grad",
    ),
    ("mean_op_empty", False, "each", "ops.masked_mean(a, m, None, 'none')", "empty"),
    (
        "mean_bwd_grad_dtype",
        False,
        "each",
        "ops.masked_mean_backward(a.long(), a, m, None, 'zero')",
        "grad",
    ),
    ("mean_op_dim", False, "each", "ops.masked_mean(a, m, [5], 'zero')", "dim"),
    (
        "mean_op_mask_dtype",
        False,
        "each",
        "ops.masked_mean(a, m.to(torch.complex64), None, 'zero')",
        "mask",
    ),
    ("C_mean_mask_shape", True, None, "C.masked_mean_fwd(a, m[:, :2], None, 'zero')", "mask"),
    ("C_mean_dim", True, None, "C.masked_mean_fwd(a, m, [7], 'zero')", "dim"),
    ("C_mean_x_dtype", True, None, "C.masked_mean_fwd(a.double(), m, None, 'zero')", "x"),
    (
        "C_mean_bwd_grad_size",
        True,
        None,
        "C.masked_mean_bwd(torch.ones(3), a, m, [1], 'zero')",
        "grad",
    ),
    ("C_whiten_x_dtype", True, None, "C.masked_whiten_fwd(a.long(), m, True, True, 1e-8)", "x"),
    (
        "C_whiten_bwd_grad_size",
        True,
        None,
        "C.masked_whiten_bwd(torch.ones(3), a, m, True, True, 1e-8)",
        "grad",
    ),
    # --- linear_distill_loss (the op and its gradients' op)
    (
        "ldl_labels_range",
        False,
        "each",
        "ops.linear_distill_loss(*ldl_with(labels=big[0]))",
        "labels",
    ),
    (
        "ldl_teacher_rows",
        False,
        "each",
        "ops.linear_distill_loss(*ldl_with(teacher_hidden=torch.randn(2, 2)))",
        "teacher_hidden",
    ),
    (
        "ldl_topk_ids_range",
        False,
        "each",
        "ops.linear_distill_loss(*ldl_with(teacher_hidden=None, teacher_weight=None, "
        "topk_ids=torch.full((3, 2), 10**9), topk_logprobs=torch.zeros(3, 2)))",
        "topk_ids",
    ),
    (
        "ldl_grads_weight_dtype",
        False,
        "each",
        "ops.linear_distill_loss_grads(*ldl_with(weight=w.double()), True, True, False)",
        "weight",
    ),
    (
        "ldl_grads_topk_shape",
        False,
        "each",
        "ops.linear_distill_loss_grads(*ldl_with(teacher_hidden=None, teacher_weight=None, "
        "topk_ids=torch.zeros(3, 2, dtype=torch.long), topk_logprobs=torch.zeros(3, 1)), True, "
        "True, False)",
        "topk_logprobs",
    ),
    # --- linear_distill_loss_sampler (the op and its gradients' op)
    (
        "lds_top_k_negative",
        False,
        "each",
        "ops.linear_distill_loss_sampler(*lds_with(top_k=-1))",
        "top_k",
    ),
    (
        "lds_temperatures_shape",
        False,
        "each",
        "ops.linear_distill_loss_sampler(*lds_with(temperatures=torch.ones(4)))",
        "temperature",
    ),
    (
        "lds_forward_kl_truncated",
        False,
        "each",
        "ops.linear_distill_loss_sampler(*lds_with(divergence='forward_kl'))",
        "divergence",
    ),
    (
        "lds_grads_top_p",
        False,
        "each",
        "ops.linear_distill_loss_sampler_grads(*lds_with(top_p=0.0), True, True, False)",
        "top_p",
    ),
    (
        "lds_grads_cached_teacher",
        False,
        "each",
        "ops.linear_distill_loss_sampler_grads(*lds_with(teacher_hidden=None, "
        "teacher_weight=None, topk_ids=torch.zeros(3, 2, dtype=torch.long), "
        "topk_logprobs=torch.zeros(3, 2)), True, True, False)",
        "topk_ids",
    ),
    # --- linear_token_logprobs
    (
        "lin_sampler_top_ks_negative",
        False,
        "each",
        "ops.linear_token_logprobs_sampler(h, w, lab3, None, 1.0, None, 0, torch.tensor([1, -1, 2]), 1.0, None, 0.0, None, 'vllm', -100, True, False, False, 0, False, 0, 'float32', None)",
        "top_k",
    ),
    (
        "lin_sampler_temperatures_shape",
        False,
        "each",
        "ops.linear_token_logprobs_sampler(h, w, lab3, None, 1.0, torch.ones(2), 0, None, 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False, 0, 'float32', None)",
        "temperature",
    ),
    (
        "lin_sampler_top_p_zero",
        False,
        "each",
        "ops.linear_token_logprobs_sampler(h, w, lab3, None, 1.0, None, 0, None, 0.0, None, 0.0, None, 'vllm', -100, True, False, False, 0, False, 0, 'float32', None)",
        "top_p",
    ),
    (
        "lin_sampler_budget_below_a_row",
        False,
        "each",
        "ops.linear_token_logprobs_sampler(h, w, lab3, None, 1.0, None, 0, None, 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False, 8, 'float32', None)",
        "max_chunk_bytes",
    ),
    (
        "lin_sampler_bwd_cut_index_size",
        False,
        "each",
        "o = ops.linear_token_logprobs_sampler(h, w, lab3, None, 1.0, None, 0, None, 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False, 0, 'float32', None)\n"
        "ops.linear_token_logprobs_sampler_backward(torch.ones(3), None, h, w, lab3, None, o[2], o[1], o[3], o[4][:1], 1.0, None, -100, 0, True, True, False, 'float32', None)",
        "cut_index",
    ),
    (
        "lin_sampler_bwd_label_1e9",
        False,
        "each",
        "o = ops.linear_token_logprobs_sampler(h, w, lab3, None, 1.0, None, 0, None, 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False, 0, 'float32', None)\n"
        "ops.linear_token_logprobs_sampler_backward(torch.ones(3), None, h, w, torch.full((3,), 10**9), None, o[2], o[1], o[3], o[4], 1.0, None, -100, 0, True, True, False, 'float32', None)",
        "labels",
    ),
    (
        "lin_bwd_label_1e9",
        False,
        "each",
        "ops.linear_token_logprobs_backward(torch.ones(3), None, h, w, torch.full((3,), 10**9), None, llse, lent, 1.0, -100, 0, True, True, False)",
        "labels",
    ),
    (
        "lin_bwd_lse_size",
        False,
        "each",
        "ops.linear_token_logprobs_backward(torch.ones(3), None, h, w, lab3, None, llse[:1], lent, 1.0, -100, 0, True, True, False)",
        "lse",
    ),
    (
        "lin_bwd_grad_size",
        False,
        "each",
        "ops.linear_token_logprobs_backward(torch.ones(1), None, h, w, lab3, None, llse, lent, 1.0, -100, 0, True, True, False)",
        "grad_logprobs",
    ),
    (
        "lin_bwd_entropy_size",
        False,
        "each",
        "ops.linear_token_logprobs_backward(torch.ones(3), torch.ones(3), h, w, lab3, None, llse, lent[:2], 1.0, -100, 0, True, True, False)",
        "entropy",
    ),
    (
        "lin_fwd_weight_shape",
        False,
        "each",
        "ops.linear_token_logprobs(h, w[:, :2], lab3, None, 1.0, -100, False, 0)",
        "weight",
    ),
    (
        "lin_fwd_bias_shape",
        False,
        "each",
        "ops.linear_token_logprobs(h, w, lab3, torch.zeros(2), 1.0, -100, False, 0)",
        "bias",
    ),
    (
        "lin_public_chunk_float",
        False,
        None,
        "pk.linear_token_logprobs(h, w, lab3, max_chunk_bytes=1.5)",
        "max_chunk_bytes",
    ),
    (
        "lin_public_logits_dtype",
        False,
        None,
        "pk.linear_token_logprobs(h, w, lab3, logits_dtype=3)",
        "logits_dtype",
    ),
    (
        "C_lin_stats_labels",
        True,
        None,
        "C.linear_logprobs_tile_stats_(torch.randn(3, 5), lab3[:1], 0, 1.0, -100, torch.zeros(3, 3), torch.zeros(3))",
        "labels",
    ),
    (
        "C_lin_stats_state",
        True,
        None,
        "C.linear_logprobs_tile_stats_(torch.randn(3, 5), lab3, 0, 1.0, -100, torch.zeros(3, 1), torch.zeros(3))",
        "state",
    ),
    (
        "C_lin_stats_zlabel",
        True,
        None,
        "C.linear_logprobs_tile_stats_(torch.randn(3, 5), lab3, 0, 1.0, -100, torch.zeros(3, 3), torch.zeros(1))",
        "zlabel",
    ),
    (
        "C_lin_bwd_lse",
        True,
        None,
        "C.linear_logprobs_tile_bwd_(torch.randn(3, 5), lab3, 0, llse[:1], None, torch.ones(3), None, 1.0, -100)",
        "lse",
    ),
    (
        "C_lin_bwd_grad",
        True,
        None,
        "C.linear_logprobs_tile_bwd_(torch.randn(3, 5), lab3, 0, llse, None, torch.ones(1), None, 1.0, -100)",
        "grad_logprobs",
    ),
    (
        "C_lin_bwd_entropy",
        True,
        None,
        "C.linear_logprobs_tile_bwd_(torch.randn(3, 5), lab3, 0, llse, lent[:1], torch.ones(3), torch.ones(3), 1.0, -100)",
        "entropy",
    ),
    # --- token_logprobs_sampler (the sampler's options and the head's statistics)
    (
        "tls_top_p_0",
        False,
        "each",
        "ops.token_logprobs_sampler(logits, labels, 1.0, None, 0, None, 0.0, None, 0.0, None, 'vllm', -100, True, False, False, 0, False)",
        "top_p",
    ),
    (
        "tls_temperature_shape",
        False,
        "each",
        "ops.token_logprobs_sampler(logits, labels, 1.0, torch.ones(3), 0, None, 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False)",
        "temperature",
    ),
    (
        "tls_temperature_zero",
        False,
        "each",
        "ops.token_logprobs_sampler(logits, labels, 1.0, torch.zeros(2), 0, None, 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False)",
        "temperature",
    ),
    (
        "tls_top_k_negative",
        False,
        "each",
        "ops.token_logprobs_sampler(logits, labels, 1.0, None, 0, torch.full((2, 3), -1), 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False)",
        "top_k",
    ),
    (
        "tls_label_1e9",
        False,
        "each",
        "ops.token_logprobs_sampler(logits, big, 1.0, None, 0, None, 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False)",
        "labels",
    ),
    (
        "tls_bwd_cut_index_size",
        False,
        "each",
        "o = ops.token_logprobs_sampler(logits, labels, 1.0, None, 0, None, 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False)\n"
        "ops.token_logprobs_sampler_backward(g6, None, logits, labels, o[2], o[1], o[3], o[4][:1], 1.0, None, -100)",
        "cut_index",
    ),
    (
        "tls_bwd_label_1e9",
        False,
        "each",
        "o = ops.token_logprobs_sampler(logits, labels, 1.0, None, 0, None, 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False)\n"
        "ops.token_logprobs_sampler_backward(g6, None, logits, big, o[2], o[1], o[3], o[4], 1.0, None, -100)",
        "labels",
    ),
    (
        "C_tls_fwd_top_ks_numel",
        True,
        None,
        "C.token_logprobs_sampler_fwd(logits, labels, 1.0, None, 0, torch.ones(5, dtype=torch.long), 1.0, None, 0.0, None, 'vllm', -100, True, False, False, 0, False)",
        "top_ks",
    ),
    (
        "C_tls_fwd_sampler",
        True,
        None,
        "C.token_logprobs_sampler_fwd(logits, labels, 1.0, None, 0, None, 0.9, None, 0.0, None, 'hf', -100, True, False, False, 0, False)",
        "sampler",
    ),
    (
        "C_tls_bwd_cut",
        True,
        None,
        "o = C.token_logprobs_sampler_fwd(logits, labels, 1.0, None, 0, None, 0.9, None, 0.0, None, 'vllm', -100, True, False, False, 0, False)\n"
        "C.token_logprobs_sampler_bwd(g6, None, logits, labels, o[2], o[1], o[3][:1], o[4], 1.0, None, -100, torch.empty_like(logits))",
        "cut",
    ),
    # --- full_kl with per-row temperatures
    (
        "fkr_temperature_shape",
        False,
        "each",
        "ops.full_kl_row_temperature(logits, ref, torch.ones(3), None)",
        "temperature",
    ),
    (
        "fkr_temperature_zero",
        False,
        "each",
        "ops.full_kl_row_temperature(logits, ref, torch.tensor([1.0, 0.0]), None)",
        "temperature",
    ),
    (
        "fkr_bwd_kl_shape",
        False,
        "each",
        "ops.full_kl_row_temperature_backward(g6, logits, ref, None, kl[:1], lz, lw, torch.ones(2), True)",
        "kl",
    ),
    # --- full_kl under the sampler's distribution
    (
        "fks_top_ks_shape",
        False,
        "each",
        "ops.full_kl_sampler(logits, ref, 1.0, None, 0, torch.ones(3, dtype=torch.long), 1.0, None, 0.0, None, 'vllm', None)",
        "top_k",
    ),
    (
        "fks_sampler",
        False,
        "each",
        "ops.full_kl_sampler(logits, ref, 1.0, None, 2, None, 1.0, None, 0.0, None, 'hf', None)",
        "sampler",
    ),
    (
        "fks_bwd_cut_shape",
        False,
        "each",
        "o = ops.full_kl_sampler(logits, ref, 1.0, None, 2, None, 1.0, None, 0.0, None, 'vllm', None)\n"
        "ops.full_kl_sampler_backward(g6, logits, ref, None, o[0], o[1], o[2], o[3][:1], o[4], 1.0, None, True)",
        "cut",
    ),
    (
        "C_fk_kept_fwd_cut_index",
        True,
        None,
        "C.full_kl_kept_fwd(logits, ref, None, 1.0, None, torch.zeros(2, 3), torch.zeros(2, 3))",
        "cut_index",
    ),
    (
        "C_fk_kept_bwd_cut",
        True,
        None,
        "C.full_kl_kept_bwd(g6, logits, ref, None, kl, lz, lw, 1.0, torch.empty_like(logits), None, None, torch.zeros(5), torch.zeros(2, 3, dtype=torch.long))",
        "cut",
    ),
    (
        "C_fk_fwd_inv_temperatures",
        True,
        None,
        "C.full_kl_fwd(logits, ref, None, 1.0, torch.ones(5, dtype=torch.float64))",
        "inv_temperatures",
    ),
    # --- the vocab-parallel forms' registered ops (ppo_kernels.distributed)
    (
        "vp_states_labels_shape",
        False,
        None,
        "ops.vocab_parallel_states(vz, vy[:3], 0, 1.0, -100)",
        "labels",
    ),
    (
        "vp_states_logits_dtype",
        False,
        None,
        "ops.vocab_parallel_states(vz.long(), vy, 0, 1.0, -100)",
        "logits",
    ),
    (
        "vp_states_vocab_start",
        False,
        None,
        "ops.vocab_parallel_states(vz, vy, -1, 1.0, -100)",
        "vocab_start",
    ),
    (
        "vp_tlp_gathered_columns",
        False,
        None,
        "ops.vocab_parallel_token_logprobs(vz, vy, vg[:, :-1], 0, 1.0, -100, True)",
        "gathered",
    ),
    (
        "vp_tlp_rank",
        False,
        None,
        "ops.vocab_parallel_token_logprobs(vz, vy, vg, 1, 1.0, -100, True)",
        "rank",
    ),
    (
        "vp_tlp_label_range",
        False,
        None,
        "ops.vocab_parallel_token_logprobs(vz, vy + 100, vg, 0, 1.0, -100, True)",
        "labels",
    ),
    (
        "vp_tlp_bwd_lse",
        False,
        None,
        "ops.vocab_parallel_token_logprobs_backward(g4, None, vz, vy, vlse[:2], vent, vlayout, 1.0, -100)",
        "lse",
    ),
    (
        "vp_tlp_bwd_grad_entropy",
        False,
        None,
        "ops.vocab_parallel_token_logprobs_backward(g4, g4[:2], vz, vy, vlse, vent, vlayout, 1.0, -100)",
        "grad_entropy",
    ),
    (
        "vp_tlp_bwd_layout",
        False,
        None,
        "ops.vocab_parallel_token_logprobs_backward(g4, None, vz, vy, vlse, vent, vlayout[:1], 1.0, -100)",
        "layout",
    ),
    (
        "vp_lin_states_weight",
        False,
        None,
        "ops.vocab_parallel_linear_states(vh, vw[:, :2], vy, None, 0, 1.0, -100, 0, 'float32')",
        "weight",
    ),
    (
        "vp_lin_states_bias",
        False,
        None,
        "ops.vocab_parallel_linear_states(vh, vw, vy, torch.randn(5), 0, 1.0, -100, 0, 'float32')",
        "bias",
    ),
    (
        "vp_lin_states_logits_dtype",
        False,
        None,
        "ops.vocab_parallel_linear_states(vh, vw, vy, None, 0, 1.0, -100, 0, 'int8')",
        "logits_dtype",
    ),
    (
        "vp_lin_gathered_columns",
        False,
        None,
        "ops.vocab_parallel_linear_token_logprobs(vh, vw, vy, None, vlg[:, :-1], 0, 1.0, -100, True, 0, 'float32', None)",
        "gathered",
    ),
    (
        "vp_lin_weight_dtype",
        False,
        None,
        "ops.vocab_parallel_linear_token_logprobs(vh, vw.double(), vy, None, vlg, 0, 1.0, -100, True, 0, 'float32', None)",
        "weight",
    ),
    (
        "vp_lin_bwd_lse",
        False,
        None,
        "ops.vocab_parallel_linear_token_logprobs_backward(g4, None, vh, vw, vy, None, vllse[:2], vlent, vllayout, 1.0, -100, 0, 'float32', True, True, True)",
        "lse",
    ),
    (
        "vp_lin_bwd_layout",
        False,
        None,
        "ops.vocab_parallel_linear_token_logprobs_backward(g4, None, vh, vw, vy, None, vllse, vlent, vllayout[:1], 1.0, -100, 0, 'float32', True, True, True)",
        "layout",
    ),
    (
        "vp_full_kl_ref_shape",
        False,
        None,
        "ops.vocab_parallel_full_kl(vz, vref[:, :3], vkl, None, 1.0)",
        "ref_logits",
    ),
    (
        "vp_full_kl_gathered_columns",
        False,
        None,
        "ops.vocab_parallel_full_kl(vz, vref, vkl[:, :-1], None, 1.0)",
        "gathered",
    ),
    (
        "vp_full_kl_mask_dtype",
        False,
        None,
        "ops.vocab_parallel_full_kl(vz, vref, vkl, g4, 1.0)",
        "mask",
    ),
    (
        "vp_states_temperatures_shape",
        False,
        None,
        "ops.vocab_parallel_states(vz, vy, 0, 1.0, -100, torch.ones(3))",
        "temperatures",
    ),
    (
        "vp_lin_states_temperatures_dtype",
        False,
        None,
        "ops.vocab_parallel_linear_states(vh, vw, vy, None, 0, 1.0, -100, 0, 'float32', torch.ones(4, dtype=torch.long))",
        "temperatures",
    ),
    (
        "vp_full_kl_temperatures_shape",
        False,
        None,
        "ops.vocab_parallel_full_kl(vz, vref, vkl, None, 1.0, torch.ones(5))",
        "temperatures",
    ),
    (
        "vp_sampler_max_labels",
        False,
        None,
        "ops.vocab_parallel_sampler_max(vz, vy[:3])",
        "labels",
    ),
    (
        "vp_sampler_hist_prefix",
        False,
        None,
        "ops.vocab_parallel_sampler_hist(vz, vm, vit, vlmp, vcut, vcut[:2], 24, True, False)",
        "prefix",
    ),
    (
        "vp_sampler_hist_floor_dtype",
        False,
        None,
        "ops.vocab_parallel_sampler_hist(vz, vm, vit, vlmp, vm, vcut, 24, True, True)",
        "floor",
    ),
    (
        "vp_sampler_ties_cut",
        False,
        None,
        "ops.vocab_parallel_sampler_ties(vz, vcut[:3])",
        "cut",
    ),
    (
        "vp_sampler_states_allow",
        False,
        None,
        "ops.vocab_parallel_sampler_states(vz, vy, vst, vm, vit, vlmp, vcut, vallow.float(), -100)",
        "allow",
    ),
    (
        "vp_sampler_states_vocab_start",
        False,
        None,
        "ops.vocab_parallel_sampler_states(vz, vy, vst.view(1), vm, vit, vlmp, vcut, vallow, -100)",
        "vocab_start",
    ),
    (
        "vp_sampler_topk_log_s",
        False,
        None,
        "ops.vocab_parallel_sampler_topk(vz, vst, vm, vit, vlmp, vcut, vallow, vsf[2][:3], 2)",
        "log_s",
    ),
    (
        "vp_sampler_topk_k",
        False,
        None,
        "ops.vocab_parallel_sampler_topk(vz, vst, vm, vit, vlmp, vcut, vallow, vsf[2], 0)",
        "k",
    ),
    (
        "vp_sampler_finish_sums",
        False,
        None,
        "ops.vocab_parallel_sampler_finish(vz, vy, vsg, vsums[:3], vm, vit, vlmp, vcut, vallow, 0, -100)",
        "sums",
    ),
    (
        "vp_sampler_finish_label_range",
        False,
        None,
        "ops.vocab_parallel_sampler_finish(vz, vy + 100, vsg, vsums, vm, vit, vlmp, vcut, vallow, 0, -100)",
        "labels",
    ),
    (
        "vp_sampler_bwd_outside",
        False,
        None,
        "ops.vocab_parallel_sampler_backward(g4, None, vz, vy, vm, vit, vlmp, vcut, vallow, vsf[2], vsf[1], vsf[3].float(), vsf[7], -100)",
        "outside",
    ),
    (
        "vp_sampler_kl_sums_ref_shape",
        False,
        None,
        "ops.vocab_parallel_sampler_kl_sums(vz, vref[:, :5], vm, vmr, vit, vlmp, vcut, vallow)",
        "ref_logits",
    ),
    (
        "vp_sampler_kl_kl_sums",
        False,
        None,
        "ops.vocab_parallel_sampler_kl(vz, vref, vsums, vkls[:1], vm, vmr, vit, vlmp, vcut, vallow, None)",
        "kl_sums",
    ),
    (
        "vp_sampler_kl_mask",
        False,
        None,
        "ops.vocab_parallel_sampler_kl(vz, vref, vsums, vkls, vm, vmr, vit, vlmp, vcut, vallow, g4)",
        "mask",
    ),
    (
        "vp_sampler_kl_bwd_kl",
        False,
        None,
        "ops.vocab_parallel_sampler_kl_backward(g4, vz, vref, vm, vmr, vit, vlmp, vcut, vallow, vklo[0][:2], vklo[1], vklo[2], None, True)",
        "kl",
    ),
    (
        "vp_sampler_bwd_layout",
        False,
        None,
        "ops.vocab_parallel_sampler_backward(g4, None, vz, vy, vm, vit, vlmp, vcut, vallow, vsf[2], vsf[1], vsf[3], vsf[7][:1], -100)",
        "layout",
    ),
]


def _expand():
    """One entry per (case, backend): 'each' runs the registered op on every CPU backend."""
    out = []
    for cid, needs_ext, backend, code, arg in CASES:
        if needs_ext and not _backend.HAS_EXTENSION:
            continue
        if backend == "each":
            # the backends that can run the op here; `linear_token_logprobs`'s name is its own key
            for b in _backend.BACKENDS:
                out.append((f"{cid}[{b}]", b, code, arg))
        else:
            out.append((cid, None, code, arg))
    return out


EXPANDED = _expand()


def _case_code(cid, backend, code):
    body = textwrap.indent(code, "        ")
    ctx = f"_backend.use_backend({backend!r})" if backend else "_backend.use_backend()"
    return f"""
try:
    with {ctx}:
{body}
    res = {{"id": {cid!r}, "raised": None}}
except RuntimeError as e:
    if "unavailable" in str(e) and "backend" in str(e):
        res = {{"id": {cid!r}, "skip": str(e)}}
    else:
        res = {{"id": {cid!r}, "raised": type(e).__name__, "msg": str(e)}}
except Exception as e:
    res = {{"id": {cid!r}, "raised": type(e).__name__, "msg": str(e)}}
print(json.dumps(res), flush=True)
"""


def _run(cases):
    script = PRELUDE + "".join(_case_code(cid, b, code) for cid, b, code, _ in cases)
    proc = subprocess.run(  # the script on stdin: argv caps one argument at 128 KiB
        [sys.executable, "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
        cwd=os.getcwd(),
        check=False,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["id"]] = r
    return proc, results


@pytest.fixture(scope="module")
def results():
    _, res = _run(EXPANDED)
    missing = [c for c in EXPANDED if c[0] not in res]
    for c in missing:  # the shared child died: one child per remaining case
        p, r = _run([c])
        res[c[0]] = r.get(c[0], {"id": c[0], "crash": p.returncode, "stderr": p.stderr[-2000:]})
    return res


@pytest.mark.parametrize("cid,backend,code,arg", EXPANDED, ids=[c[0] for c in EXPANDED])
def test_bad_input_is_a_clear_error(results, cid, backend, code, arg):
    r = results[cid]
    if "skip" in r:  # the backend does not run here
        pytest.skip(unavailable(backend, r["skip"]))
    assert "crash" not in r, f"{code!r} crashed the process (rc {r['crash']}): {r['stderr']}"
    assert r["raised"] is not None, f"{code!r} was accepted"
    first = r["msg"].strip().splitlines()[0] if r["msg"].strip() else ""
    assert arg in first, f"{code!r} raised {r['raised']}: {first!r}, which does not name {arg!r}"
