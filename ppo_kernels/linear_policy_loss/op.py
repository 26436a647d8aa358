"""The Python side of the registered ops `ppo_kernels::linear_policy_loss` and
`ppo_kernels::linear_policy_loss_grads`, defined in C++ (csrc/ops/linear_policy_loss.cpp: schemas,
checks, routing, autograd): the chunk loop that computes the loss and its gradients in one pass
over the hidden-state rows, registered per backend, the fake kernels and the extension-less
fallback. Semantics: naive.py; public function: api.py.

The chunk loop (one pass, "3 GEMMs"): for each block of rows, the logits tile h W^T (+ b)
(linear_logprobs' Tiler: float32 tiles, or the input dtype with logits_dtype="input"; soft-capped)
-> the token_logprobs forward kernel gives log-prob, entropy and log-sum-exp per row -> the
per-token coefficients dL/dlogprob and dL/dentropy (policy_math's stage 2 with the row
coefficients of the aggregation, plus the KL and entropy terms) -> the token_logprobs backward
kernel turns the tile into the logits gradient in place -> grad_hidden rows = G W and
grad_W += G^T h (float32 sums), grad_b += sum G. The logits are computed once: one GEMM forward,
two for the gradients, none in autograd's backward (which only scales these by the upstream
gradient). The registered op hands the cpp backend's CPU calls of the clipped types in float32
or with bf16 / fp16 input tiles (policy_math.is_ppo_surrogate; no weights, bypass mode, soft-cap or
reference head) to the same loop written in C++ (csrc/cpu/linear_policy_loss.cpp, routed in
csrc/ops/linear_policy_loss.cpp): without the ~150 small torch ops per call that this loop spends
around the kernels, and with each row reduced in cache, statistics to gradient (one exp per logit
where the two token_logprobs kernels take two).

What is known before the loop (stage-1 statistics from masks and given tensors): the mask weights,
the aggregation's row coefficients c_b (token / sequence counts, global normalisers), the caller's
and the rollout-correction weights (computed from old vs rollout log-probs by the API). What is
not: statistics of the current log-probs over a whole sequence (sequence-level IS / GSPO, gspo,
geo_mean) or over the whole batch (clip_cov, kl_cov, and rollout correction in bypass mode, whose
weights and rejection come from the current log-probs). Per-sequence ones cost nothing when each
chunk holds whole sequences (its rows are a multiple of T); a sequence longer than a chunk, and
every batch statistic, takes a first pass over all rows computing log-probs only (one GEMM per
chunk), then the full pass: 4 GEMMs instead of 3 (`passes` in the plan, measured in
bench/results/cpu_linear_policy_loss.md).

Tiles always cover the whole vocabulary (the token_logprobs kernels reduce them in one pass): the
row chunk is the planner's, and at least one row when a row of V logits exceeds the budget.

Batch-invariant mode (README "Batch-invariant mode"): the rows come from planner.plan_invariant
(a function of V, H, dtype, device and logits_dtype only), every tile zero-padded as the plan
says (the Tiler: to a multiple of 32 rows on the CPU, to the plan's rows elsewhere), and the
per-token math of a chunk (policy coefficients, sampled KL, IS weights)
runs on inputs padded the same way -- the chunk's tokens padded to the tile's rows, whole-row
(sequence) statistics on a multiple of INVARIANT_ROW_MULTIPLE rows -- on one thread, so that no
elementwise op ends a token in its scalar remainder or splits at a thread-dependent point. Then a
token's log-prob, entropy and KL do not depend on the rest of the call, and its hidden gradient
depends only on its own inputs and its coefficients (which the aggregation may tie to the batch:
token counts, batch statistics).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_devices, check_labels_in_range, check_str
from ..full_kl import op as fk_op
from ..fused_linear.planner import (
    INVARIANT_ROW_MULTIPLE,
    Plan,
    _acc,
    _resolve_budget,
    plan_chunks,
    plan_invariant,
)
from ..fused_linear.tiler import Tiler
from ..kl import naive as kl_ref
from ..losses import policy_math as pm
from ..losses import rollout_correction as rc
from ..losses.naive import OP_STAT_NAMES_POLICY, row_coefficients
from ..losses.policy_loss import CONFIG_ARGS
from ..token_logprobs import op as tl_op
from . import naive

_policy_op = _backend.op("ppo_policy_loss")
# the backward ops exist with the extension only (so does the route below that calls them)
_policy_bwd = _backend.op("ppo_policy_loss_backward") if _backend.HAS_EXTENSION else None
_kl_op = _backend.op("kl_penalty")
_aggregate_op = _backend.op("masked_aggregate")
_kl_bwd = _backend.op("kl_penalty_backward") if _backend.HAS_EXTENSION else None

OP = _backend.register_op(
    "linear_policy_loss",
    kernel="token_logprobs_fwd",
    triton=True,
    cuda_default="triton",
    folder="linear_policy_loss",
    delegates={
        ("cpp", "cpu"): "BLAS matmuls + the token_logprobs and loss C++ kernels (ppo-surrogate "
        "types in float32 or with bf16 / fp16 input tiles: one C++ loop, each row reduced in "
        "cache, csrc/cpu/linear_policy_loss.cpp)",
        ("cpp", "cuda"): "cuBLAS matmuls (torch.mm) + the token_logprobs CUDA kernels",
        ("triton", "cuda"): "cuBLAS matmuls (torch.mm) + the token_logprobs Triton kernels",
        ("eager", "cpu"): "BLAS matmuls (torch.mm) + eager tile math",
        ("eager", "cuda"): "cuBLAS matmuls (torch.mm) + eager tile math",
    },
)
_backend.routes_in_cpp("linear_policy_loss")

# The arguments of both registered ops, in schema order (csrc/ops/linear_policy_loss.cpp;
# checked against the schema at import). linear_policy_loss_grads adds need_hidden, need_weight,
# need_bias.
ARG_NAMES = (
    "hidden",
    "weight",
    "labels",
    "advantages",
    "old_logprobs",
    "mask",
    "bias",
    "ref_logprobs",
    "weights",
    "global_denom",
    "ref_hidden",
    "ref_weight",
    "ref_bias",
    *CONFIG_ARGS,  # loss_type ... kl_cov_coef
    "agg",
    "scale",
    "global_denom_value",
    "kl_coef",
    "kl_estimator",
    "kl_straight_through",
    "kl_in_lo",
    "kl_in_hi",
    "kl_out_lo",
    "kl_out_hi",
    "entropy_coef",
    "temperature",
    "softcap",
    "ignore_index",
    "max_chunk_bytes",
    "logits_dtype",
    "bypass_mode",
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "generator",
)
NEED_NAMES = ("need_hidden", "need_weight", "need_bias")
Call = NamedTuple("Call", [(n, object) for n in ARG_NAMES + NEED_NAMES])

if _backend.HAS_EXTENSION:
    _schema = _backend.registered("linear_policy_loss_grads").default._schema
    assert tuple(a.name for a in _schema.arguments) == ARG_NAMES + NEED_NAMES, (
        "csrc/ops/linear_policy_loss.cpp and op.ARG_NAMES disagree"
    )

# the per-token outputs (token_stats rows)
TOKEN_STATS = ("logprobs", "entropy", "kl")


# --------------------------------------------------------------------------- configuration
def config(a) -> pm.LossConfig:
    """The LossConfig of a call (the API checked the values; the op checks the type's name)."""
    check_str("loss_type", a.loss_type, pm.LOSS_TYPES)
    check_str("importance_sampling_level", a.importance_sampling_level, ("token", "sequence"))
    return naive.loss_config(a)


def bypass_options(a):
    """(level, is_spec, rs_specs) of rollout correction in bypass mode, or None."""
    if not a.bypass_mode:
        return None
    return rc.check_options(
        a.rollout_is, a.rollout_is_threshold, a.rollout_rs, a.rollout_rs_threshold
    )


def _dummy_inputs():
    one = torch.ones(1, 1, dtype=torch.float64)
    return pm.Inputs(one * -0.5, one * -0.6, one, one)


def _token_metric_names(cfg: pm.LossConfig) -> tuple[str, ...]:
    """The per-token statistics policy_math reports for a type (from a 1-token run: they depend
    on the configuration only)."""
    key = (cfg.loss_type, cfg.sequence_level)
    if key not in _TOKEN_METRICS:
        x = _dummy_inputs()
        _TOKEN_METRICS[key] = tuple(pm.token_terms(cfg, x, pm.statistics(cfg, x)).metrics)
    return _TOKEN_METRICS[key]


_TOKEN_METRICS: dict = {}
_NAMES: dict = {}


@_backend.constant_result
def _stat_names(loss_type, sequence_level, dro_beta, per_row_adv, has_ref, bypass):
    """stat_names of a configuration given as plain values (torch.compile evaluates it while
    tracing: the names are constants of the graph)."""
    key = (loss_type, sequence_level, dro_beta, per_row_adv, has_ref, bypass)
    if key in _NAMES:
        return _NAMES[key]
    level = "sequence" if sequence_level else "token"
    cfg = pm.LossConfig(loss_type, importance_sampling_level=level, dro_beta=dro_beta)
    x = _dummy_inputs()
    names = ["pg_loss", "entropy_loss", "entropy_mean", "masked_fraction"]
    if has_ref:
        names += ["kl_loss", "kl_mean"]
    values = dict.fromkeys(_token_metric_names(cfg), x.m)
    names += list(values) + list(pm.row_metrics(values, x.m, sequence_level and per_row_adv))
    if bypass is not None:
        level, is_spec, batch_normalize, rs = bypass
        w, _, met = rc.compute(x.lp, x.old, x.m, level, is_spec, batch_normalize, list(rs))
        names += ["is_weight_mean"] if w is not None else []
        names += [f"rollout_corr/{k}" for k in met]
    _NAMES[key] = tuple(names)
    return _NAMES[key]


def stat_names(a) -> tuple[str, ...]:
    """The names of the `stats` output, in order (they depend on the configuration only)."""
    opts = bypass_options(a)
    bypass = None
    if opts is not None:
        level, is_spec, rs = opts
        bypass = (level, is_spec, bool(a.rollout_is_batch_normalize), tuple(map(tuple, rs)))
    return _stat_names(
        a.loss_type,
        a.importance_sampling_level == "sequence",
        a.dro_beta if a.loss_type == "dro" else None,
        a.advantages.dim() == 1,
        a.ref_logprobs is not None or a.ref_hidden is not None,
        bypass,
    )


def plan(
    hidden: Tensor, V: int, logits_dtype: str, max_chunk_bytes: int, share: int = 1, fused=True
) -> Plan:
    """linear_logprobs' row plan with whole-vocabulary tiles (at least one row per chunk) within
    1 / share of the budget (share tiles side by side); in batch-invariant mode plan_invariant
    (the call's N and max_chunk_bytes play no part). fused=False: input-dtype tiles get a float32
    copy (the per-chunk tile kernels of a vocabulary shard)."""
    N, H = hidden.shape
    dt, dev = hidden.dtype, hidden.device
    if _backend.invariant():
        p = plan_invariant(V, H, dt, dev.type, "rows", logits_dtype, fused, budget_share=share)
    else:
        budget = max(1, _resolve_budget(max_chunk_bytes, dev) // share)
        p = plan_chunks(N, V, H, dt, dev.type, budget, "rows", logits_dtype, fused=fused)
    return p if p.vocab == V else dataclasses.replace(p, vocab=V)


def _pad_to(t: Tensor | None, n: int) -> Tensor | None:
    """t with its leading dimension zero-padded to n rows (batch-invariant mode)."""
    if t is None or t.shape[0] == n:
        return t
    out = t.new_zeros((n,) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _whole_rows(n: int) -> int:
    """How many rows whole-row (sequence) statistics run on: n, or in batch-invariant mode n
    rounded up to a multiple of INVARIANT_ROW_MULTIPLE -- a [rows, T] elementwise op then never
    ends in a scalar remainder (whose exp / log may differ from the vectorised loop's)."""
    if not _backend.invariant():
        return n
    k = INVARIANT_ROW_MULTIPLE
    return -(-n // k) * k


def token_local_bypass(opts, batch_normalize: bool) -> bool:
    """Bypass mode whose weights are per token and that rejects nothing: the weights of a token
    come from its own log-prob, in the one pass (the statistics from all of them at the end)."""
    level, is_spec, rs = opts
    return not rs and not batch_normalize and level in (None, "token")


def passes(cfg: pm.LossConfig, bypass: bool, T: int, rows: int) -> int:
    """1, or 2 when a statistic of the current log-probs spans more than a chunk: a batch
    statistic (clip_cov, kl_cov, bypass-mode rollout correction with a rejection, sequence
    weights or batch normalisation) or a sequence statistic of a sequence longer than the chunk."""
    scope = pm.stat_scope(cfg)
    if bypass or scope == "batch" or (scope == "sequence" and T > rows):
        return 2
    return 1


def _full_kl_kernels(backend: str, device_type: str, temperature: float):
    """full_kl's tile kernels (full_kl/op.py) for `backend` on a pair of logits tiles:
    fwd(z, zr) -> (kl, lse_z, lse_w) and bwd(g, z, zr, kl, lse_z, lse_w, out) -> dKL/dz scaled per
    row by g, written into `out`."""
    inv_t = 1.0 / temperature
    if backend == "cpp" and not _backend.has_compiled_kernel("full_kl_fwd", device_type):
        backend = "eager"
    f, b = fk_op.forward.impls[backend], fk_op.backward.impls[backend]

    def fwd(z, zr):
        return f(z, zr, None, inv_t)

    def bwd(g, z, zr, kl, lse_z, lse_w, out):
        b(z, g, zr, None, kl, lse_z, lse_w, inv_t, out, None)
        return out

    return fwd, bwd


class WholeVocab:
    """How the chunk loop (run) reduces a row block's logits tile when the tile holds the whole
    vocabulary: the token_logprobs kernels give the row statistics and turn the tile into its
    gradient, the full_kl kernels give the exact KL. The vocab-parallel form
    (ppo_kernels/distributed/vocab_parallel_policy.py) replaces it for a vocabulary shard: the
    per-chunk tile kernels, the row statistics merged across the ranks."""

    fused = True  # the fused whole-vocabulary kernels reduce the tiles (planned as such)
    partial = False  # grad_hidden is a partial sum (reduced by the caller, kept in float32)
    rows = None  # the plan's rows per chunk (a shard: the rows common to every rank)

    def __init__(self, backend: str, device_type: str, temperature: float, ignore_index: int):
        self.backend, self.inv_t, self.ii = backend, 1.0 / temperature, ignore_index
        self.fwd, self.bwd = tl_op.forward.impls[backend], tl_op.backward.impls[backend]
        self.kl_fwd, self.kl_bwd = _full_kl_kernels(backend, device_type, temperature)

    def stats(self, tiler, z, zr, lc, with_entropy):
        """(logprobs, entropy, lse, (kl, lse_z, lse_w) or None) of a row block from its logits
        tile z (and the reference head's zr, or None)."""
        lp, ent, lse = self.fwd(z, lc, self.inv_t, self.ii, with_entropy)
        return lp, ent, lse, (None if zr is None else self.kl_fwd(z, zr))

    def grad(self, tiler, z, glp, gent, lc, lse, ent, alone):
        """The tile's gradient d(sum(glp * lp + gent * ent)) / dz (z is consumed); alone: no
        other term is added to it (Triton may then round it to the input dtype as it stores)."""
        g = tiler.grad_tile(z, rounds_on_store=self.backend == "triton" and alone)
        self.bwd(z, glp, gent, lc, lse, ent if gent is not None else lse, self.inv_t, self.ii, g)
        return g


# --------------------------------------------------------------------------- the chunk loop
class _Prepared(NamedTuple):
    """Per-token [B, T] inputs in the accumulation dtype, zero off the mask."""

    m: Tensor
    old: Tensor
    adv: Tensor
    ref: Tensor | None
    w: Tensor | None  # the caller's (and the API's rollout-correction) weights


def _prepare(a, acc) -> _Prepared:
    mask = a.mask
    B, T = mask.shape
    m = mask.to(acc)
    keep = m != 0
    zero = torch.zeros((), dtype=acc, device=m.device)
    m = torch.where(keep, m, zero)
    adv = a.advantages.to(acc)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand(B, T)
    ref = None if a.ref_logprobs is None else torch.where(keep, a.ref_logprobs.to(acc), zero)
    w = None if a.weights is None else torch.where(keep, a.weights.to(acc), zero)
    return _Prepared(
        m, torch.where(keep, a.old_logprobs.to(acc), zero), torch.where(keep, adv, zero), ref, w
    )


def _global_denominator(a, acc, dev):
    if a.global_denom is not None:
        return a.global_denom.reshape(()).to(acc)
    if a.global_denom_value is not None:
        return torch.tensor(a.global_denom_value, dtype=acc, device=dev)
    return None


class _Loss:
    """The loss terms of one call: coefficients per token for the gradient, per-token values for
    the statistics, and the loss sums."""

    def __init__(self, a, cfg, p: _Prepared, gden, token_stats, one_pass: bool, cpp: bool):
        self.a, self.cfg, self.p, self.gden = a, cfg, p, gden
        # The cpp backend, float32 on the CPU: the per-token terms by the registered ops' kernels
        # where they have them (the sampled KL; ppo's surrogate -- every clipped type at token
        # level -- without weights: each chunk's coefficients, then the loss and every
        # statistic, two calls instead of policy_math's ~100 small ops). The eager and triton
        # backends keep policy_math's torch ops, float64 the float64 composition, batch-invariant
        # mode its padded one, CUDA the torch ops until a GPU run shows the loss kernels under
        # graph capture (the 2026-11-30 H200 run left ppo_policy_loss's open).
        self.kernels = (
            cpp
            and _backend.HAS_EXTENSION
            and p.m.dtype == torch.float32
            and p.m.device.type == "cpu"
            and not _backend.invariant()
        )
        self.ppo = self.kernels and one_pass and pm.is_ppo_surrogate(cfg) and p.w is None
        self.one = torch.ones((), dtype=p.m.dtype, device=p.m.device)
        self.lp_all, self.ent_all, self.kl_all = token_stats[0], token_stats[1], token_stats[2]
        self.per_row_adv = a.advantages.dim() == 1
        self.kl_est = a.kl_estimator
        self.kl_bounds = (a.kl_in_lo, a.kl_in_hi, a.kl_out_lo, a.kl_out_hi)
        self.full_kl = a.ref_hidden is not None  # the exact KL against a reference head
        self.has_kl = p.ref is not None or self.full_kl
        self.set_mask(p.m, p.w)
        self.metrics: dict[str, Tensor] = {}  # per-token values of policy_math's statistics
        self.extra: dict[str, Tensor] = {}  # statistics computed whole (bypass mode)
        self.pg = torch.zeros((), dtype=p.m.dtype, device=p.m.device)

    def set_mask(self, m, w):
        """The mask (after any rejection) and the weights of the policy term: the row
        coefficients of the aggregation, and per token k = c_b m (KL and entropy terms)."""
        self.m, self.w = m, w
        if self.kernels:  # masked_aggregate's kernel: the row coefficients of the mask, one call
            self.c = _aggregate_op(m, m, self.a.agg, self.a.scale, self.gden, None)[1]
        else:
            self.c = row_coefficients(m, self.a.agg, self.a.scale, self.gden)
        self._c_tok = None
        self.k = self.c.unsqueeze(-1) * m

    @property
    def c_tok(self) -> Tensor:
        """c_b of each token, flat (token scope; made on first use)."""
        if self._c_tok is None:
            self._c_tok = self.c.unsqueeze(-1).expand(self.m.shape).reshape(-1)
        return self._c_tok

    def policy(self, lp, b0, b1, t0=None, t1=None, generator=None, w_is=None):
        """Stage 1 (rows b0:b1 whole, or tokens t0:t1 of the flattened batch at token scope) and
        stage 2: adds the rows' loss, stores their metric values; returns dL/dlp, flat. w_is:
        [len(lp), 1] weights of these tokens beside the prepared ones (bypass mode, one pass).
        Batch-invariant mode: token scope takes lp padded to the tile's rows (the padding
        tokens are off the mask) and returns as many coefficients; whole rows are padded with
        empty rows to _whole_rows(b1 - b0) (batch statistics excepted: their coefficients
        depend on the batch anyway) and their coefficients returned with the padding."""
        p, cfg = self.p, self.cfg
        if t0 is None:  # whole rows: their statistics here
            k = b1 - b0 if pm.stat_scope(cfg) == "batch" else _whole_rows(b1 - b0)

            def rows(t):
                return None if t is None else _pad_to(t[b0:b1], k)

            x = pm.Inputs(_pad_to(lp, k), rows(p.old), rows(p.adv), rows(self.m))
            c, w = rows(self.c), rows(self.w)
        else:  # token scope: each token one row of its own (no statistic crosses tokens)
            k = lp.shape[0]

            def col(t):
                return _pad_to(t.reshape(-1)[t0:t1], k).unsqueeze(-1)

            x = pm.Inputs(lp.unsqueeze(-1), col(p.old), col(p.adv), col(self.m))
            c = _pad_to(self.c_tok[t0:t1], k)
            w = None if self.w is None else col(self.w)
            if w_is is not None:
                w = w_is if w is None else w * w_is
        with _backend.invariant_threads():
            st = pm.statistics(cfg, x, generator) if t0 is None else pm.Stats(x.m.squeeze(-1))
            terms = pm.token_terms(cfg, x, st)
            loss, coef = pm.combine(terms, x, c, pm.token_weights(cfg, x, st, w))
        self.pg = self.pg + loss
        self._store(terms.metrics, x, b0, b1, t0, t1)
        return coef.reshape(-1)

    def ppo_policy(self, lp, t0, t1):
        """dL/dlp of tokens t0:t1 (lp: their log-probs) by the "ppo" kernels' backward:
        [rows, T] when the chunk holds whole rows, else one row per token with its c_b."""
        cfg, p, T = self.cfg, self.p, self.p.m.shape[1]

        def tok(t):
            return t.reshape(-1)[t0:t1]

        if t0 % T == 0 and (t1 - t0) % T == 0:
            shape, coef = (-1, T), self.c[t0 // T : t1 // T]
        else:
            shape, coef = (-1, 1), self.c_tok[t0:t1]
        g = _policy_bwd(
            self.one,
            lp.reshape(shape),
            tok(p.old).reshape(shape),
            tok(p.adv).reshape(shape),
            tok(self.m).reshape(shape),
            coef.contiguous(),
            cfg.clip_low,
            cfg.clip_high,
            cfg.dual_clip,
            cfg.log_ratio_clamp,
        )
        return g.reshape(-1)

    def _ppo_loss(self) -> dict[str, Tensor]:
        """The policy term and its statistics (verl's and TRL's) by the "ppo" kernels' forward
        on every token's log-prob."""
        cfg, p, m = self.cfg, self.p, self.m
        a = self.a
        self.pg, st, _ = _policy_op(
            self.lp_all,  # (the kernels skip the tokens off the mask)
            p.old,
            p.adv,
            m,
            cfg.clip_low,
            cfg.clip_high,
            cfg.dual_clip,
            cfg.log_ratio_clamp,
            a.agg,
            a.scale,
            self.gden,
            None,
        )
        return dict(zip(OP_STAT_NAMES_POLICY, st.unbind(0), strict=True))

    def _store(self, values, x, b0, b1, t0, t1):
        B, T = self.p.m.shape
        for name, v in values.items():
            if v is None:
                continue
            buf = self.metrics.get(name)
            if buf is None:
                buf = self.metrics[name] = torch.zeros(B, T, dtype=x.m.dtype, device=x.m.device)
            if t0 is None:
                buf[b0:b1] = v[: b1 - b0]
            else:
                buf.view(-1)[t0:t1] = v.reshape(-1)[: t1 - t0]

    def _tok(self, t, t0, t1, n):
        """Tokens t0:t1 of a [B, T] tensor, zero-padded to n (the tile's rows)."""
        return _pad_to(t.reshape(-1)[t0:t1], n)

    def kl_and_entropy(self, lp, t0, t1):
        """(dL/dlp of the KL term or None, dL/dentropy or None) of tokens t0:t1 (lp: their
        log-probs, padded to the tile's rows in batch-invariant mode, and so the results); stores
        the KL."""
        a, n = self.a, lp.shape[0]
        k = self._tok(self.k, t0, t1, n)
        glp = None
        if self.p.ref is not None:
            ref = self._tok(self.p.ref, t0, t1, n)
            keep = self._tok(self.m, t0, t1, n) != 0
            zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
            if self.kernels:
                kl = _kl_op(lp, ref, self.kl_est, False, *self.kl_bounds)
                self.kl_all.view(-1)[t0:t1] = torch.where(keep, kl, zero)[: t1 - t0]
                if a.kl_coef != 0:
                    g = _kl_bwd(k, lp, ref, self.kl_est, a.kl_straight_through,
                                *self.kl_bounds, True, False)[0]  # fmt: skip
                    glp = a.kl_coef * torch.where(keep, g, zero)
                return glp, self._entropy_coef(k)
            with _backend.invariant_threads():
                kl = kl_ref.kl_penalty(lp, ref, self.kl_est, False, self.kl_bounds)
                self.kl_all.view(-1)[t0:t1] = torch.where(keep, kl.to(lp.dtype), zero)[: t1 - t0]
                if a.kl_coef != 0:
                    g = kl_ref.kl_penalty_grad(
                        lp, ref, self.kl_est, a.kl_straight_through, self.kl_bounds
                    )
                    glp = a.kl_coef * torch.where(keep, k * g.to(lp.dtype), zero)
        return glp, self._entropy_coef(k)

    def _entropy_coef(self, k):
        return None if self.a.entropy_coef == 0 else -self.a.entropy_coef * k

    def full_kl_coef(self, kl, t0, t1):
        """Stores the exact KL of tokens t0:t1 (kl: padded as in kl_and_entropy); returns dL/dKL
        per token (None: no KL term)."""
        n = kl.shape[0]
        keep = self._tok(self.m, t0, t1, n) != 0
        self.kl_all.view(-1)[t0:t1] = torch.where(keep, kl.to(self.m.dtype), 0.0)[: t1 - t0]
        if self.a.kl_coef == 0:
            return None
        return self.a.kl_coef * self._tok(self.k, t0, t1, n)

    def finish(self, names) -> tuple[Tensor, Tensor]:
        """(loss, stats in the order of `names`) once every row has its per-token values."""
        a, m = self.a, self.m
        kernel_stats = self._ppo_loss() if self.ppo else None
        ent = torch.where(m != 0, self.ent_all, torch.zeros_like(self.ent_all))
        # [entropy (, KL)] x [k, m]: their aggregations (k = c_b m) and their masked sums
        vals = torch.stack((ent, self.kl_all)) if self.has_kl else ent[None]
        sums = (vals[:, None] * torch.stack((self.k, m))).sum((-2, -1))
        total = m.sum()
        means = torch.where(total != 0, sums[:, 1] / total, 0.0)  # (no gradient: 0 / 0 is dropped)
        ent_agg = sums[0, 0]
        loss = self.pg - a.entropy_coef * ent_agg
        # masked_fraction: the share of the mask's tokens rejected (bypass mode sets it)
        st = {"pg_loss": self.pg, "entropy_loss": ent_agg, "masked_fraction": 0 * ent_agg}
        st["entropy_mean"] = means[0]
        if self.has_kl:
            loss = loss + a.kl_coef * sums[1, 0]
            st["kl_loss"], st["kl_mean"] = sums[1, 0], means[1]
        if kernel_stats is not None:
            st.update(kernel_stats)
        else:
            values = {n: self.metrics.get(n) for n in _token_metric_names(self.cfg)}
            st.update(pm.masked_means(values, m))
            st.update(pm.row_metrics(values, m, self.cfg.sequence_level and self.per_row_adv))
        st.update(self.extra)
        out = [st[n] for n in names]
        if not all(v.dim() == 0 and v.dtype == m.dtype for v in out):
            out = [v.to(m.dtype).reshape(()) for v in out]
        return loss, torch.stack(out)


def run(backend: str, a, vocab: WholeVocab | None = None) -> tuple[Tensor, ...]:
    """linear_policy_loss_grads on `backend` ("cpp", "triton", "eager"): the arguments as the
    schema names them (Call). vocab: how a tile is reduced (default WholeVocab; the
    vocab-parallel form passes its shard's, whose labels it has checked against the whole
    vocabulary)."""
    hidden, weight, bias, labels = a.hidden, a.weight, a.bias, a.labels
    N, H = hidden.shape
    V = weight.shape[0]
    B, T = labels.shape
    dev = hidden.device
    acc = _acc(hidden.dtype)
    if vocab is None:
        if dev.type == "cpu" or _backend.strict():
            check_labels_in_range(labels, V, a.ignore_index)
        vocab = WholeVocab(backend, dev.type, a.temperature, a.ignore_index)
    cfg = config(a)
    names = stat_names(a)
    bypass = bypass_options(a)
    need_h, need_w = a.need_hidden, a.need_weight
    need_b = a.need_bias and bias is not None
    token_stats = _backend.new_output((3, B, T), acc, dev)
    token_stats[2].zero_()  # the KL row stays 0 without ref_logprobs
    gh_dtype = acc if vocab.partial else hidden.dtype
    gh_out = _backend.new_output((N, H) if need_h else (0,), gh_dtype, dev)
    gW = torch.zeros((V, H) if need_w else (0,), dtype=acc, device=dev)
    gb = torch.zeros((V,) if need_b else (0,), dtype=acc, device=dev)
    p = _prepare(a, acc)
    L = _Loss(
        a, cfg, p, _global_denominator(a, acc, dev), token_stats, bypass is None, backend == "cpp"
    )
    full = a.ref_hidden is not None
    # the exact KL: the reference tile and its gradient tile beside the policy tile
    share = 3 if full else 1
    pl = plan(hidden, V, a.logits_dtype, a.max_chunk_bytes, share, vocab.fused)
    if vocab.rows is not None:
        pl = dataclasses.replace(pl, rows=vocab.rows)
    any_grad = need_h or need_w or need_b
    fused = backend if vocab.fused else False
    tiler = Tiler(hidden, weight, bias, pl, fused, backward=any_grad, softcap=a.softcap)
    pad = tiler.pad  # batch-invariant mode: per-token tensors of a chunk to the tile's rows
    if full:
        rpl = dataclasses.replace(
            plan(a.ref_hidden, V, a.logits_dtype, a.max_chunk_bytes, share), rows=pl.rows
        )
        rtiler = Tiler(a.ref_hidden, a.ref_weight, a.ref_bias, rpl, backend, softcap=a.softcap)
        gk_buf = torch.empty(
            tiler.max_rows * V if any_grad else 0,
            dtype=tiler.buf_in.dtype if pl.input_tiles else acc,
            device=dev,
        )
    ii = a.ignore_index
    gh = torch.empty((tiler.max_rows, H) if need_h else (0,), dtype=acc, device=dev)
    lp_flat, ent_flat = L.lp_all.view(-1), L.ent_all.view(-1)
    local = bypass is not None and token_local_bypass(bypass, a.rollout_is_batch_normalize)
    n_pass = passes(cfg, bypass is not None and not local, T, pl.rows)
    # bypass, one pass: the IS weights of gpg / reinforce per chunk (the clipped types' ratio
    # already is pi / pi_rollout: their loss does not change)
    chunk_is = local and bypass[1] is not None and cfg.loss_type not in pm.CLIP_TYPES
    scope = pm.stat_scope(cfg)

    if n_pass == 2:
        # first pass: the log-probs of every row (one GEMM per chunk), then every statistic
        for r0 in range(0, N, pl.rows):
            r1 = min(N, r0 + pl.rows)
            z = tiler.logits(tiler.rows(r0, r1), 0, V)
            lc = pad(labels.view(-1)[r0:r1], ii)
            lp_flat[r0:r1] = vocab.stats(tiler, z, None, lc, False)[0][: r1 - r0]
        if bypass is not None:
            _bypass(L, bypass)
        lpm = torch.where(L.m != 0, L.lp_all, torch.zeros_like(L.lp_all))
        coef_all = L.policy(lpm, 0, B, generator=a.generator)[:N]
        step = pl.rows
    else:
        coef_all = None
        step = pl.rows if scope == "token" or T == 0 else max(1, pl.rows // T) * T

    lab = labels.reshape(-1)
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        # (in batch-invariant mode every per-token tensor below has the tile's rows: padded)
        hc, lc = tiler.rows(r0, r1), pad(lab[r0:r1], ii)
        z = tiler.logits(hc, 0, V)
        zr = rtiler.logits(rtiler.rows(r0, r1), 0, V) if full else None
        lp, ent, lse, klt = vocab.stats(tiler, z, zr, lc, True)
        ent_flat[r0:r1] = ent[: r1 - r0]
        if coef_all is not None:
            lp = pad(lp_flat[r0:r1])  # the first pass's (the same rows: the same values)
            glp = pad(coef_all[r0:r1])
        else:
            lp_flat[r0:r1] = lp[: r1 - r0]
            if L.ppo:  # (the kernels skip the tokens off the mask)
                glp = L.ppo_policy(lp, r0, r1)
            elif scope == "token":
                lpm = torch.where(pad(L.m.view(-1)[r0:r1]) != 0, lp, torch.zeros_like(lp))
                w_is = None
                if chunk_is:
                    m_c = pad(L.m.view(-1)[r0:r1])[:, None]
                    lr = lpm[:, None] - pad(L.p.old.view(-1)[r0:r1])[:, None]
                    with _backend.invariant_threads():
                        w_is = rc.importance_weights(lr, m_c, "token", *bypass[1], False)[0]
                glp = L.policy(lpm, 0, 0, r0, r1, w_is=w_is)
            else:
                lpm = torch.where(pad(L.m.view(-1)[r0:r1]) != 0, lp, torch.zeros_like(lp))
                lps = lpm[: r1 - r0].view(-1, T)
                glp = pad(L.policy(lps, r0 // T, r1 // T, generator=a.generator)[: r1 - r0])
        g_kl, gent = L.kl_and_entropy(lp, r0, r1)
        if g_kl is not None:
            glp = glp + g_kl
        gk = None
        if full:
            kl, lse_z, lse_w = klt
            g_full = L.full_kl_coef(kl, r0, r1)
            if g_full is not None and any_grad:
                gk = gk_buf[: z.numel()].view(z.shape)
                gk = vocab.kl_bwd(g_full, z, zr, kl, lse_z, lse_w, gk)
        if not any_grad:
            continue
        tiler.softcap_grad(z)
        g = vocab.grad(tiler, z, glp, gent, lc, lse, ent, gk is None)
        if gk is not None:
            g += gk
        tiler.apply_softcap_grad(g)
        ghc = gh[: hc.shape[0]].zero_() if need_h else gh
        tiler.grad_matmuls(g, hc, 0, V, ghc, gW, gb)
        if need_h:
            gh_out[r0:r1] = ghc[: r1 - r0]
    if local:
        _bypass(L, bypass, apply=False)
    loss, stats = L.finish(names)
    return loss, stats, token_stats, gh_out, gW, gb


def _bypass(L: _Loss, opts, apply=True):
    """Rollout correction in bypass mode (old_logprobs are the rollout log-probs): weights and
    rejection from the current log-probs (detached), after the first pass; apply=False: only its
    statistics (the one-pass case applied the weights per chunk)."""
    level, is_spec, rs = opts
    p = L.p
    lp = torch.where(L.m != 0, L.lp_all, torch.zeros_like(L.lp_all))
    w, keep, met = rc.compute(lp, p.old, L.m, level, is_spec, L.a.rollout_is_batch_normalize, rs)
    mask0 = L.m
    m, pw = L.m, L.w
    if keep is not None:
        m = m * keep
    extra = {}
    a0 = (mask0 != 0).sum().to(m.dtype)
    a1 = (m != 0).sum().to(m.dtype)
    extra["masked_fraction"] = torch.where(a0 > 0, (a0 - a1) / a0.clamp(min=1), a0 * 0)
    if w is not None:
        extra["is_weight_mean"] = pm.masked_means({"w": w}, m)["w"]
        if L.cfg.loss_type not in pm.CLIP_TYPES:  # the clipped ratio already is pi / pi_rollout
            pw = w if pw is None else pw * w
    extra.update({f"rollout_corr/{k}": v for k, v in met.items()})
    if apply:
        L.set_mask(m, pw)
    L.extra = extra


def _impl(backend):
    def impl(*args):
        return run(backend, Call(*args))

    impl.__name__ = f"linear_policy_loss_grads_{backend}"
    return impl


for _b in _backend.BACKENDS:
    _backend.impl("linear_policy_loss_grads", _b)(_impl(_b))


def _fake_outputs(a):
    hidden = a.hidden
    acc = _acc(hidden.dtype)
    B, T = a.labels.shape
    loss = hidden.new_empty((), dtype=acc)
    stats = hidden.new_empty((len(stat_names(a)),), dtype=acc)
    return loss, stats, hidden.new_empty((3, B, T), dtype=acc)


# The tensor arguments after hidden, each on hidden's device: the fakes and the fallback check it
# as the C++ checks do (a meta tensor sends a call to its fake whatever the other arguments').
_ON_HIDDENS_DEVICE = (
    "weight", "labels", "advantages", "old_logprobs", "mask", "bias", "ref_logprobs", "weights",
    "global_denom", "ref_hidden", "ref_weight", "ref_bias",
)  # fmt: skip


def _check_devices(a):
    check_devices("hidden", a.hidden, **{n: getattr(a, n) for n in _ON_HIDDENS_DEVICE})


@_backend.fake("linear_policy_loss")
def _(*args):
    a = Call(*args, False, False, False)
    _check_devices(a)
    return _fake_outputs(a)


@_backend.fake("linear_policy_loss_grads")
def _(*args):
    a = Call(*args)
    _check_devices(a)
    hidden, weight = a.hidden, a.weight
    acc = _acc(hidden.dtype)
    N, H = hidden.shape
    V = weight.shape[0]
    gh = hidden.new_empty((N, H) if a.need_hidden else (0,))
    gW = hidden.new_empty((V, H) if a.need_weight else (0,), dtype=acc)
    gb = hidden.new_empty((V,) if (a.need_bias and a.bias is not None) else (0,), dtype=acc)
    return (*_fake_outputs(a), gh, gW, gb)


# --------------------------------------------------------------------------- without the extension
class _Precomputed(torch.autograd.Function):
    """A chunk loop with its gradients attached, as the C++ autograd kernel does: runner(call)
    gives run's outputs (the eager loop here; the vocab-parallel form's loop)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, runner, *args):
        need = ctx.needs_input_grad[:3]
        call = Call(*args, need[0], need[1], need[2] and bias is not None)
        loss, stats, tok, gh, gW, gb = runner(call)
        ctx.save_for_backward(gh, gW, gb)
        ctx.need, ctx.dtype = need, weight.dtype
        ctx.mark_non_differentiable(stats, tok)
        return loss, stats, tok

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, *_):
        gh, gW, gb = ctx.saved_tensors
        h, w, b = ctx.need
        return (
            gh * g if h else None,
            (gW * g).to(ctx.dtype) if w else None,
            (gb * g).to(ctx.dtype) if b else None,
            *(None,) * (1 + len(ARG_NAMES)),
        )


def with_grads(runner, args) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, stats, token_stats) of the op's arguments `args` by runner(Call) (run's outputs),
    the gradients of hidden / weight / bias that require grad attached to the loss."""
    a = Call(*args, False, False, False)
    if not (
        torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (a.hidden, a.weight, a.bias))
    ):
        return runner(a)[:3]
    return _Precomputed.apply(a.hidden, a.weight, a.bias, runner, *args)


@_backend.fallback("linear_policy_loss")
def _(*args):
    _check_devices(Call(*args, False, False, False))
    return with_grads(lambda call: run("eager", call), args)
