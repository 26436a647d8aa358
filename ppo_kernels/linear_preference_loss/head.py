"""linear_preference_loss's head term (fused_linear/engine.py): what a preference loss makes of each
token's log-prob -- the sequence log-probs of whole completions, the preference math
(losses/preference_math.py: every type's loss and its analytic d loss / d sequence log-prob), and
from them the per-token coefficients dL/dlogprob of the gradient tile.

The rows are completions of T tokens. Paired types walk the rows pair by pair (engine.Head.order:
a pair's chosen and rejected rows side by side), so that a block of whole pairs knows every
coefficient of its tokens; a pair longer than a block either runs by pairs (engine.run_units: each
row's coefficient is one scalar times its mask, applied to per-row gradient accumulators once the
pair is reduced) or, like the types whose coefficients need the whole batch (aot / aot_unpaired's
sort), takes the engine's first pass (log-probs only), then every coefficient at once. Unpaired
types (KTO) need whole rows only.

What is known before the loop: the token weights k (the mask, its means, LD-DPO's weights), the
token counts, the reference's sequence log-probs when given. A reference head's token log-probs
come from its tile beside the policy tile (engine.WholeVocab's `ref`), reduced by the same
weights; with a first pass, from a pass over the reference head before it.

Under the rollout sampler's distribution (linear_preference_loss_sampler) each head's reduction
flags the labels outside its kept set (`outside`, walk order; the reference head's pass runs
first). With mask_outside such a token leaves its completion -- mask, token weights, counts -- as
soon as its block's flags are known: a block of whole pairs then still knows its coefficients. The
SFT term's batch token count needs every block's flags: a first pass.

Batch-invariant mode: every per-row computation (the sequence sums, the per-pair math, the
rewards) runs on rows padded to a multiple of INVARIANT_ROW_MULTIPLE on one thread, as
linear_policy_loss's head does, so that a row's outputs do not depend on the rest of the call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from ..fused_linear.engine import Block, HeadTerm, pad_to
from ..fused_linear.planner import INVARIANT_ROW_MULTIPLE
from ..linear_policy_loss.head import truncates
from ..losses import preference_math as prm
from ..losses import preference_unpaired as prpu
from ..losses.config import fields, make
from ..losses.preference_config import PreferenceLossConfig

CONFIG_FIELDS = fields(PreferenceLossConfig)


def check_reference(cfg: PreferenceLossConfig, has_reference: bool):
    """ValueError for a reference given to the reference-free types (orpo, simpo, cpo)."""
    free = [t for t in cfg.loss_type if t in prm.REFERENCE_FREE_TYPES]
    if free and has_reference:
        raise ValueError(
            f"ref_logps: {free} are reference-free; pass neither ref_logps nor ref_hidden"
        )


def config(a) -> PreferenceLossConfig:
    """The PreferenceLossConfig of the op's arguments `a` (checked once per distinct values)."""
    values = {k: getattr(a, k) for k in CONFIG_FIELDS}
    values["loss_type"] = tuple(values["loss_type"])
    if values["loss_weights"] is not None:
        values["loss_weights"] = tuple(values["loss_weights"])
    return make(PreferenceLossConfig, **values)


PAIRED_STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
UNPAIRED_STATS = (
    "kl",
    "chosen_rewards_sum",
    "rejected_rewards_sum",
    "chosen_logps_sum",
    "rejected_logps_sum",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@_backend.constant_result
def _stat_names(loss_type: tuple, sampled: bool = False) -> tuple[str, ...]:
    if loss_type[0] in prm.UNPAIRED_TYPES:
        names = UNPAIRED_STATS
    else:
        names = PAIRED_STATS
        if "sft" in loss_type:
            names += ("nll_loss",)
        if "orpo" in loss_type:
            names += ("log_odds_ratio", "log_odds_chosen")
    return names + ("num_outside",) if sampled else names


def stat_names(a) -> tuple[str, ...]:
    """The names of the `stats` output, in order (they depend on the loss types, and the
    sampler's op adds num_outside)."""
    return _stat_names(tuple(a.loss_type), hasattr(a, "mask_outside"))


# row_stats: per row (original order)
ROW_STATS = ("logps", "ref_logps", "rewards")
# token_stats: per token (entropy with with_entropy, the last two with with_logit_stats; else 0)
TOKEN_STATS = ("logprobs", "entropy", "ref_logprobs", "mean_logits", "is_top1")


def unit_rows(cfg: PreferenceLossConfig, T: int) -> int:
    """The tokens a block must hold whole for one pass: a pair (2T), or a row (T) unpaired."""
    return T if cfg.unpaired else 2 * T


def is_batch_scope(cfg: PreferenceLossConfig) -> bool:
    """Whether a coefficient needs every pair of the batch (the sorted types): a first pass."""
    return not cfg.unpaired and prm.stat_scope(cfg.paired_config()) == "batch"


def _padded_rows(n: int) -> int:
    """n, or in batch-invariant mode n rounded up to a multiple of INVARIANT_ROW_MULTIPLE (no
    elementwise op over rows then ends in a vectorised loop's scalar remainder)."""
    if not _backend.invariant():
        return n
    k = INVARIANT_ROW_MULTIPLE
    return -(-n // k) * k


class Layout:
    """Where each completion is: `rows` [R] the original rows in the order the loop walks them
    (paired: chosen_0, rejected_0, chosen_1, ...; None: as given), `order` the same for the flat
    tokens (engine.Head.order; None: as given), P the pairs (0 unpaired)."""

    def __init__(self, cfg: PreferenceLossConfig, pairs: Tensor | None, R: int, T: int, device):
        self.R, self.T = R, T
        self.paired = not cfg.unpaired
        self.rows = self.order = None
        self.P = 0
        if not self.paired:
            return
        self.P = R // 2
        if pairs is None:
            if self.P <= 1:  # [chosen; rejected] of one pair is already side by side
                return
            half = torch.arange(self.P, device=device)
            rows = torch.stack((half, half + self.P), 1).reshape(-1)
        else:
            rows = pairs.to(device=device, dtype=torch.long).reshape(-1)
        self.rows = rows
        self.order = (rows.unsqueeze(1) * T + torch.arange(T, device=device)).reshape(-1)

    def walk(self, t: Tensor | None) -> Tensor | None:
        """A per-row tensor [R, ...] in walk order."""
        return t if (t is None or self.rows is None) else t.index_select(0, self.rows)

    def unwalk_(self, out: Tensor, walked: Tensor) -> Tensor:
        """out[rows] = walked (per row along dim -1 of a [k, R] tensor, or a flat [N] token
        tensor when `walked` has N elements)."""
        if self.rows is None:
            out.copy_(walked)
        elif out.dim() == 1:
            out.index_copy_(0, self.order, walked)
        else:
            out.index_copy_(out.dim() - 1, self.rows, walked)
        return out


class PreferenceHead(HeadTerm):
    """The preference loss's head term for one call (`a`: the op's arguments, labels already
    with the mask folded in as `labels`): per block of whole pairs (or rows) the sequence
    log-probs, the math's derivatives and the per-token coefficients."""

    def __init__(
        self, a, cfg: PreferenceLossConfig, layout: Layout, labels: Tensor, acc, outside=None
    ):
        self.a, self.cfg, self.L = a, cfg, layout
        self.with_entropy = bool(a.with_entropy)
        R, T = labels.shape
        dev = labels.device
        self.acc, self.T = acc, T
        m = (labels != a.ignore_index).to(acc)  # [R, T], original order
        self.paired = layout.paired
        if self.paired:
            self.pcfg = cfg.paired_config()
            # the token weights in [chosen; rejected] order (LD-DPO's follow the pair)
            P = layout.P
            cr = None if layout.rows is None else layout.rows.view(P, 2).T.reshape(-1)
            m_cr = m if cr is None else m.index_select(0, cr)
            k_cr = prm.sequence_token_weights(m_cr, cfg.average_log_prob, cfg.ld_alpha)
            k = k_cr.view(2, P, T).transpose(0, 1).reshape(R, T)  # walk order
            self.m = m_cr.view(2, P, T).transpose(0, 1).reshape(R, T)
            self.n = self.m.sum(-1)
            self.n_chosen_total = self.n[0::2].sum()
        else:
            self.ucfg = cfg.unpaired_config()
            k = prm.sequence_token_weights(m, cfg.average_log_prob)
            self.m = m
            self.desirable = a.desirable.to(torch.bool)
            self.kl = None if a.reference_point is None else a.reference_point.reshape(())
        self.k = k.to(acc)
        self.ref_given = None
        if a.ref_logps is not None:
            self.ref_given = layout.walk(a.ref_logps.to(acc))
        self.has_ref = a.ref_logps is not None or a.ref_hidden is not None
        # filled per block (walk order): the sequence log-probs, the reference's, the rewards
        self.seq = torch.zeros(R, dtype=acc, device=dev)
        self.ref_seq = torch.zeros(R, dtype=acc, device=dev)
        self.rewards = torch.zeros(R, dtype=acc, device=dev)
        self.chosen_sum = torch.zeros(R, dtype=acc, device=dev)  # plain masked sums (sft)
        self.ref_tok = None  # [N] the reference head's token log-probs (walk order; op.run)
        self.coef_all = None  # every token's dL/dlogprob, after a first pass
        self.group = unit_rows(cfg, T)  # tokens a block holds whole
        self.batch_scope = is_batch_scope(cfg)
        # the sampler's: (the policy's, the reference head's or None) outside flags [N] (walk
        # order), and whether those tokens leave their completions
        self.outside = outside
        self.mask_outside = outside is not None and bool(a.mask_outside) and truncates(a)
        self.batch_tokens = self.mask_outside and self.paired and "sft" in cfg.loss_type

    # ------------------------------------------------------------------ the engine's interface
    def step(self, rows: int, T: int) -> int:
        return max(1, rows // self.group) * self.group

    def passes(self, rows: int, T: int) -> int:
        return 2 if self.needs_first_pass(rows) else 1

    def needs_first_pass(self, rows: int) -> bool:
        return self.batch_scope or self.batch_tokens or (self.group > rows and self.R > 0)

    @property
    def R(self) -> int:
        return self.m.shape[0]

    def after_first_pass(self, lp: Tensor) -> None:
        """Every coefficient from every log-prob (flat [N], walk order)."""
        R, T = self.m.shape
        if self.mask_outside:
            self._drop_outside(0, R)
            if self.paired:
                self.n_chosen_total = self.n[0::2].sum()
        ref = None if self.ref_tok is None else self.ref_tok.view(R, T)
        coef = self._rows(0, R, lp.view(R, T), ref)
        self.coef_all = coef.reshape(-1)

    def coefficients(self, blk: Block):
        r0, r1, pad = blk.r0, blk.r1, blk.pad
        if self.coef_all is not None:
            return pad(self.coef_all[r0:r1]), None, None
        T = self.T
        n = r1 - r0
        w0, w1 = r0 // T, r1 // T
        lp = blk.lp[:n].view(-1, T)
        if blk.kl is not None:  # the reference tile's token log-probs (else its pass gave them)
            self.ref_tok[r0:r1] = blk.kl[0][:n]
        ref = None if self.ref_tok is None else self.ref_tok[r0:r1].view(-1, T)
        if self.mask_outside:  # the block's flags are known now (the reference's before)
            self._drop_outside(w0, w1)
        coef = self._rows(w0, w1, lp, ref)
        return pad(coef.reshape(-1)), None, None

    def _drop_outside(self, w0: int, w1: int) -> None:
        """Rows w0:w1 (walk order; whole pairs or rows): each token whose label is outside the
        policy's or the reference head's kept set leaves the mask, the token weights and the
        counts (LD-DPO's shared length and the means follow)."""
        T = self.T
        pol, ref = (None if t is None else t[w0 * T : w1 * T].view(-1, T) for t in self.outside)
        out = pol if ref is None else pol | ref
        m = torch.where(out, torch.zeros((), dtype=self.m.dtype, device=out.device), self.m[w0:w1])
        self.m[w0:w1] = m
        if self.paired:  # the weights take [chosen; rejected] rows
            p = m.shape[0] // 2
            k_cr = prm.sequence_token_weights(
                torch.cat((m[0::2], m[1::2])), self.cfg.average_log_prob, self.cfg.ld_alpha
            )
            self.k[w0:w1] = k_cr.view(2, p, T).transpose(0, 1).reshape(-1, T)
            self.n[w0:w1] = m.sum(-1)
        else:
            self.k[w0:w1] = prm.sequence_token_weights(m, self.cfg.average_log_prob)

    # ------------------------------------------------------------------ the loss
    def _rows(self, w0: int, w1: int, lp: Tensor, ref_tok: Tensor | None) -> Tensor:
        """Rows w0:w1 (walk order; whole pairs) with their token log-probs lp [rows, T] (and the
        reference head's ref_tok): stores their sequence log-probs and rewards, returns their
        dL/dlogprob [rows, T]."""
        rows = w1 - w0
        kk = _padded_rows(rows)
        acc = self.acc

        def sl(t):
            return pad_to(t[w0:w1], kk)

        with _backend.invariant_threads():
            k, m = sl(self.k), sl(self.m)
            lpp = pad_to(lp.to(acc), kk)
            if self.outside is not None:  # a dropped token's -inf log-prob: 0 off the mask
                lpp = torch.where(m != 0, lpp, 0.0)
                if ref_tok is not None:
                    ref_tok = torch.where(m[:rows] != 0, ref_tok, 0.0)
            seq = (k * lpp).sum(-1)
            if self.ref_given is not None:
                ref = sl(self.ref_given)
            elif ref_tok is not None:
                ref = (k * pad_to(ref_tok, kk)).sum(-1)
            else:
                ref = None
            beta = self.cfg.beta
            self.rewards[w0:w1] = (beta * (seq if ref is None else seq - ref))[:rows]
            self.seq[w0:w1] = seq[:rows]
            if ref is not None:
                self.ref_seq[w0:w1] = ref[:rows]
            if self.paired:
                plain = (m * lpp).sum(-1)
                self.chosen_sum[w0:w1] = plain[:rows]
                n = sl(self.n)
                res = self._paired_loss(
                    seq, ref, n, plain, num_pairs=self.L.P, num_chosen_tokens=self.n_chosen_total
                )
                d_seq = torch.stack((res.d_chosen, res.d_rejected), 1).reshape(-1)
                coef = d_seq.unsqueeze(-1) * k
                if res.d_chosen_sum is not None:
                    sft = torch.zeros_like(coef)
                    sft[0::2] = res.d_chosen_sum.unsqueeze(-1) * m[0::2]
                    coef = coef + sft
            else:
                res = prpu.unpaired_loss(
                    self.ucfg,
                    seq,
                    ref,
                    pad_to(self.desirable[w0:w1], kk),
                    kl=self.kl,
                    num_rows=max(self.R, 1),
                )
                coef = res.d_logps.unsqueeze(-1) * k
            if self.outside is not None:  # a completion whose loss is not finite: no gradient
                coef = torch.where(torch.isfinite(coef), coef, 0.0)
        return coef[:rows]

    def _paired_loss(self, seq, ref, n, chosen_sum, **totals):
        """preference_math.paired_loss of rows in walk order: each pair's chosen row, then its
        rejected row (`totals`: the whole batch's counts, for a block's share)."""
        return prm.paired_loss(
            self.pcfg,
            seq[0::2],
            seq[1::2],
            None if ref is None else ref[0::2],
            None if ref is None else ref[1::2],
            n_chosen=n[0::2],
            n_rejected=n[1::2],
            chosen_sum=chosen_sum[0::2],
            **totals,
        )

    def result(self) -> tuple[Tensor, Tensor]:
        """(loss, stats) once every row has its sequence log-prob: the whole batch's math (the
        same terms the blocks differentiated)."""
        ref = self.ref_seq if self.has_ref else None
        if self.paired:
            seq, n = self.seq, self.n
            res = self._paired_loss(seq, ref, n, self.chosen_sum)
        else:
            res = prpu.unpaired_loss(self.ucfg, self.seq, ref, self.desirable, kl=self.kl)
        names = _stat_names(tuple(self.cfg.loss_type))
        out = [res.metrics[k].to(self.acc).reshape(()) for k in names]
        stats = torch.stack(out) if out else self.seq.new_zeros(0)
        return res.loss.to(self.acc).reshape(()), stats
