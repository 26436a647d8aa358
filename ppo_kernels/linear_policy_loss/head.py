"""linear_policy_loss's head term (fused_linear/engine.py): what the policy loss makes of each
token's log-prob, entropy and KL -- the per-token coefficients dL/dlogprob, dL/dentropy, dL/dKL of
the gradient tile, the loss sums and the statistics it reports.

What is known before the loop (stage-1 statistics from masks and given tensors): the mask weights,
the aggregation's row coefficients c_b (token / sequence counts, global normalisers), the caller's
and the rollout-correction weights (computed from old vs rollout log-probs by the API). What is
not: statistics of the current log-probs over a whole sequence (sequence-level IS / GSPO, gspo,
geo_mean) or over the whole batch (clip_cov, kl_cov, and rollout correction in bypass mode, whose
weights and rejection come from the current log-probs). Per-sequence ones cost nothing when each
block holds whole sequences (its rows are a multiple of T); a sequence longer than a block, and
every batch statistic, takes the engine's first pass (log-probs only), then the full pass
(`passes`).

Under the rollout sampler's distribution (linear_policy_loss_sampler) the reduction flags each label
outside the kept set (`outside`): masked out of the loss by default -- as mask 0, before any
coefficient or normaliser, so a first pass of log-probs finds them (`passes`) -- and counted in
`num_outside` (the tokens of the op's mask whose label is outside).

The per-token terms: the cpp backend's float32 CPU calls reach the registered ops' kernels
(`ppo_policy_loss`'s backward for the clipped types, `kl_penalty`, `masked_aggregate`); every other
call runs policy_math's torch ops (batch-invariant mode: on inputs padded as the tiles are, on one
thread, so that no elementwise op ends a token in its scalar remainder).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import _backend
from ..fused_linear.engine import Block, HeadTerm, pad_to
from ..fused_linear.planner import INVARIANT_ROW_MULTIPLE
from ..kl import naive as kl_ref
from ..losses import policy_math as pm
from ..losses import rollout_correction as rc
from ..losses.config import PolicyLossConfig, fields, make
from ..losses.naive import OP_STAT_NAMES_POLICY, row_coefficients

_policy_op = _backend.op("ppo_policy_loss")
# the backward ops exist with the extension only (so does the path that calls them)
_policy_bwd = _backend.op("ppo_policy_loss_backward") if _backend.HAS_EXTENSION else None
_kl_op = _backend.op("kl_penalty")
_aggregate_op = _backend.op("masked_aggregate")
_kl_bwd = _backend.op("kl_penalty_backward") if _backend.HAS_EXTENSION else None


def config(a) -> PolicyLossConfig:
    """The PolicyLossConfig of the op's arguments `a` (checked once per distinct values)."""
    return make(PolicyLossConfig, **{k: getattr(a, k) for k in CONFIG_FIELDS})


CONFIG_FIELDS = fields(PolicyLossConfig)


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


def _token_metric_names(cfg: PolicyLossConfig) -> tuple[str, ...]:
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
def _stat_names(
    loss_type, sequence_level, dro_beta, per_row_adv, has_ref, bypass, sampled=False, z=False
):
    """stat_names of a configuration given as plain values (torch.compile evaluates it while
    tracing: the names are constants of the graph)."""
    key = (loss_type, sequence_level, dro_beta, per_row_adv, has_ref, bypass, sampled, z)
    if key in _NAMES:
        return _NAMES[key]
    level = "sequence" if sequence_level else "token"
    cfg = PolicyLossConfig(loss_type, importance_sampling_level=level, dro_beta=dro_beta)
    x = _dummy_inputs()
    names = ["pg_loss", "entropy_loss", "entropy_mean", "masked_fraction"]
    if sampled:
        names += ["num_outside"]
    if z:
        names += ["z_loss"]
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
        hasattr(a, "mask_outside"),
        True if a.z_loss != 0 else False,  # (a branch: torch.compile specialises on it)
    )


def truncates(a) -> bool:
    """Whether the sampler's options of the call `a` may leave a label outside the kept set: a
    truncation on (a per-row tensor counts as on: its values are not read)."""
    return (
        a.top_ks is not None
        or a.top_ps is not None
        or a.min_ps is not None
        or 0 < a.top_k < a.weight.shape[0]
        or a.top_p < 1
        or a.min_p > 0
    )


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


def passes(cfg: PolicyLossConfig, bypass: bool, T: int, rows: int) -> int:
    """1, or 2 when a statistic of the current log-probs spans more than a chunk: a batch
    statistic (clip_cov, kl_cov, bypass-mode rollout correction with a rejection, sequence
    weights or batch normalisation) or a sequence statistic of a sequence longer than the chunk."""
    scope = pm.stat_scope(cfg)
    if bypass or scope == "batch" or (scope == "sequence" and T > rows):
        return 2
    return 1


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


class PolicyHead(HeadTerm):
    """The policy loss's head term for one call (`a`: the op's arguments): coefficients per token
    for the gradient, per-token values for the statistics, and the loss sums."""

    def __init__(self, a, backend: str, token_stats: Tensor, outside: Tensor | None = None):
        acc = token_stats.dtype
        dev = token_stats.device
        cfg = config(a)
        self.names = stat_names(a)
        self.bypass = bypass_options(a)
        p = _prepare(a, acc)
        gden = _global_denominator(a, acc, dev)
        # the sampler's distribution: the outside flags [B, T] the reduction writes, and whether
        # those tokens leave the mask (then before any coefficient: a first pass finds them)
        self.outside = outside
        self.mask_outside = outside is not None and bool(a.mask_outside) and truncates(a)
        one_pass = self.bypass is None and not self.mask_outside
        cpp = backend == "cpp"
        self.a, self.cfg, self.p, self.gden = a, cfg, p, gden
        # The cpp backend, float32 on the CPU: the per-token terms by the registered ops' kernels
        # where they have them (the sampled KL; ppo's surrogate -- every clipped type at token
        # level -- without weights: each chunk's coefficients, then the loss and every
        # statistic, two calls instead of policy_math's ~100 small ops). The eager and triton
        # backends keep policy_math's torch ops, float64 the float64 composition, batch-invariant
        # mode its padded one, CUDA the torch ops until a GPU check shows the loss kernels under
        # graph capture.
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
        bypass = self.bypass
        self.local = (
            bypass is not None
            and not self.mask_outside
            and token_local_bypass(bypass, a.rollout_is_batch_normalize)
        )
        # bypass, one pass: the IS weights of gpg / reinforce per block (the clipped types' ratio
        # already is pi / pi_rollout: their loss does not change)
        self.chunk_is = self.local and bypass[1] is not None and cfg.loss_type not in pm.CLIP_TYPES
        self.scope = pm.stat_scope(cfg)
        self.coef_all = None  # every token's dL/dlogprob, after a first pass
        # the z-loss: every token's log-sum-exp (of the tempered logits, 0 without a label)
        self.lse_all = torch.zeros_like(p.m) if a.z_loss != 0 else None

    # ------------------------------------------------------------------ the engine's interface
    def step(self, rows: int, T: int) -> int:
        """Blocks of whole sequences when a per-sequence statistic needs them."""
        return rows if self.scope == "token" or T == 0 else max(1, rows // T) * T

    def passes(self, rows: int, T: int) -> int:
        if self.mask_outside:
            return 2
        return passes(self.cfg, self.bypass is not None and not self.local, T, rows)

    def after_first_pass(self, lp: Tensor) -> None:
        """Every coefficient from every log-prob (and bypass mode's weights and rejection); the
        labels outside the sampler's kept set first leave the mask (mask_outside)."""
        if self.mask_outside:  # as mask 0: the inputs zero there too (as _prepare leaves them)
            keep = ~self.outside
            zero = torch.zeros((), dtype=self.m.dtype, device=self.m.device)

            def kept(t):
                return None if t is None else torch.where(keep, t, zero)

            p = self.p
            self.p = p._replace(old=kept(p.old), adv=kept(p.adv), ref=kept(p.ref), w=kept(p.w))
            self.set_mask(kept(self.m), kept(self.w))
        if self.bypass is not None:
            _bypass(self, self.bypass)
        lpm = torch.where(self.m != 0, self.lp_all, torch.zeros_like(self.lp_all))
        B = self.m.shape[0]
        self.coef_all = self.policy(lpm, 0, B, generator=self.a.generator)[: lp.shape[0]]

    def coefficients(self, blk: Block):
        r0, r1, lp, pad = blk.r0, blk.r1, blk.lp, blk.pad
        if self.coef_all is not None:
            glp = pad(self.coef_all[r0:r1])
        elif self.ppo:  # (the kernels skip the tokens off the mask)
            glp = self.ppo_policy(lp, r0, r1)
        elif self.scope == "token":
            lpm = torch.where(pad(self.m.view(-1)[r0:r1]) != 0, lp, torch.zeros_like(lp))
            w_is = None
            if self.chunk_is:
                m_c = pad(self.m.view(-1)[r0:r1])[:, None]
                lr = lpm[:, None] - pad(self.p.old.view(-1)[r0:r1])[:, None]
                with _backend.invariant_threads():
                    w_is = rc.importance_weights(lr, m_c, "token", *self.bypass[1], False)[0]
            glp = self.policy(lpm, 0, 0, r0, r1, w_is=w_is)
        else:
            T = self.m.shape[1]
            lpm = torch.where(pad(self.m.view(-1)[r0:r1]) != 0, lp, torch.zeros_like(lp))
            lps = lpm[: r1 - r0].view(-1, T)
            glp = pad(self.policy(lps, r0 // T, r1 // T, generator=self.a.generator)[: r1 - r0])
        g_kl, gent = self.kl_and_entropy(lp, r0, r1)
        if g_kl is not None:
            glp = glp + g_kl
        g_full = None
        if self.full_kl:
            g_full = self.full_kl_coef(blk.kl[0], r0, r1)
        if self.lse_all is None:
            return glp, gent, g_full
        return glp, gent, g_full, self.z_loss_coef(blk.lse, r0, r1)  # dL/dlse

    def result(self) -> tuple[Tensor, Tensor]:
        """(loss, stats) once the loop is done."""
        if self.local:
            _bypass(self, self.bypass, apply=False)
        return self.finish(self.names)

    # ------------------------------------------------------------------ the loss terms
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
                return None if t is None else pad_to(t[b0:b1], k)

            x = pm.Inputs(pad_to(lp, k), rows(p.old), rows(p.adv), rows(self.m))
            c, w = rows(self.c), rows(self.w)
        else:  # token scope: each token one row of its own (no statistic crosses tokens)
            k = lp.shape[0]

            def col(t):
                return pad_to(t.reshape(-1)[t0:t1], k).unsqueeze(-1)

            x = pm.Inputs(lp.unsqueeze(-1), col(p.old), col(p.adv), col(self.m))
            c = pad_to(self.c_tok[t0:t1], k)
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
        return pad_to(t.reshape(-1)[t0:t1], n)

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

    def z_loss_coef(self, lse, t0, t1):
        """Stores the log-sum-exp of tokens t0:t1 (padded as in kl_and_entropy); returns the
        z-loss's dL/dlse = 2 z_loss m lse / sum(m) per token (0 for an empty mask)."""
        n = lse.shape[0]
        self.lse_all.view(-1)[t0:t1] = lse[: t1 - t0]
        m = self.m
        total = m.sum()
        c = torch.where(total != 0, 2.0 * self.a.z_loss / torch.where(total != 0, total, 1.0), 0.0)
        return c * self._tok(m, t0, t1, n) * lse

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
        if self.outside is not None:  # the op's mask tokens whose label is outside the kept set
            st["num_outside"] = (self.outside & (self.p.m != 0)).sum().to(m.dtype)
        st["entropy_mean"] = means[0]
        if self.has_kl:
            loss = loss + a.kl_coef * sums[1, 0]
            st["kl_loss"], st["kl_mean"] = sums[1, 0], means[1]
        if self.lse_all is not None:  # mean over the mask of lse^2 (0 for an empty mask)
            zsum = (m * self.lse_all * self.lse_all).sum()
            st["z_loss"] = torch.where(total != 0, zsum / torch.where(total != 0, total, 1.0), 0.0)
            loss = loss + a.z_loss * st["z_loss"]
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


def _bypass(L: PolicyHead, opts, apply=True):
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
