"""linear_distill_loss's head term (fused_linear/engine.py): what the distillation loss makes of
each token's statistics -- the divergence D_t, the hard-label log-prob lp_t (temperature 1) and
the sampled-token reverse KL k_t that the reduction (op.TeacherTiles / op.TopkTiles) gives per
row block -- stored per token, and the coefficients d L / d lp_t and d L / d D_t of the gradient
tile (the reduction forms the tile from them).

Liger's reduction, L = w_soft sum_t D_t / n + w_hard sum_t (-lp_t) / n over the n kept tokens
(label not ignored, mask set; at least 1), needs only n beyond a block, and n is known before the
loop: one pass. The math (coefficients and the final sums) is losses/distill_math.py's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..fused_linear.engine import Block, HeadTerm
from ..losses import distill_math as dm
from ..losses.distill_config import DistillLossConfig

# token_stats rows
TOKEN_STATS = ("divergence", "hard_logprobs", "sampled_reverse_kl")
STAT_NAMES = ("soft_loss", "hard_loss")


class DistillHead(HeadTerm):
    """The distillation loss's head term. keep [N] bool: the tokens in the loss; token_stats
    [3, N] (TOKEN_STATS) is filled block by block (0 off keep)."""

    with_entropy = False

    def __init__(self, cfg: DistillLossConfig, keep: Tensor, token_stats: Tensor):
        self.cfg, self.keep, self.tok = cfg, keep, token_stats
        self.n = dm.num_kept(keep, token_stats.dtype)
        # every token's coefficients (None: a term of weight 0)
        self.d_value, self.d_hard = dm.coefficients(cfg, keep, self.n)

    def coefficients(self, blk: Block):
        """(d L / d lp_t, None, d L / d D_t) of the block's (padded) rows, after storing its
        per-token values; blk.kl = (D_t, lp_t, k_t) from the reduction."""
        r0, r1, pad = blk.r0, blk.r1, blk.pad
        n = r1 - r0
        keep = pad(self.keep[r0:r1], False)
        zero = torch.zeros((), dtype=self.tok.dtype, device=self.tok.device)
        for row, v in enumerate(blk.kl):
            self.tok[row, r0:r1] = torch.where(keep, v.to(self.tok.dtype), zero)[:n]
        d_hard = None if self.d_hard is None else pad(self.d_hard[r0:r1])
        d_value = None if self.d_value is None else pad(self.d_value[r0:r1])
        return d_hard, None, d_value

    def result(self) -> tuple[Tensor, Tensor]:
        """(loss, stats [soft_loss, hard_loss]) once every block is stored."""
        r = dm.combine(self.cfg, self.tok[0], self.tok[1], self.keep, self.n)
        return r.loss, torch.stack((r.soft_loss, r.hard_loss))
