"""The whole per-token step of a PPO update, for tests/ops/test_ppo_step.py (compile, no host
sync) and tests/cuda/test_cuda_losses.py (its CUDA-graph capture)."""

import torch

import ppo_kernels as pk


def make_inputs(B=4, T=16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + 0.2 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    mask[-1, T // 2 :] = False
    x = dict(
        logprobs=lp,
        values=torch.randn(B, T, generator=g),
        old_logprobs=old,
        ref_logprobs=old + 0.1 * torch.randn(B, T, generator=g),
        old_values=torch.randn(B, T, generator=g),
        scores=torch.randn(B, generator=g),
        mask=mask,
        beta=torch.tensor(0.05),  # an adaptive KL coefficient: a tensor, read on the device
    )
    x["num_tokens"] = mask.sum()  # the data-parallel totals, device-side
    x["num_seqs"] = mask.any(-1).sum().float()
    return {k: v.to(device) for k, v in x.items()}


def ppo_step(
    logprobs, values, old_logprobs, ref_logprobs, old_values, scores, mask, beta, num_tokens,
    num_seqs,
):  # fmt: skip
    """(loss, policy clip fraction, value clip fraction): the step's forward; backward by the
    caller."""
    rewards, _, _ = pk.kl_penalized_rewards(
        scores, old_logprobs, ref_logprobs, mask, beta=beta, estimator="k3"
    )
    adv, returns = pk.gae(rewards, old_values, mask, gamma=1.0, lam=0.95)
    adv = pk.masked_whiten(adv, mask)
    pl, pst = pk.ppo_policy_loss(
        logprobs,
        old_logprobs,
        adv,
        mask,
        clip_high=0.28,
        dual_clip=3.0,
        agg="seq-mean-token-mean",
        global_batch_size=num_seqs,
    )
    vl, vst = pk.ppo_value_loss(
        values, old_values, returns, mask, clip=0.2, global_num_tokens=num_tokens
    )
    return pl + 0.5 * vl, pst["clip_frac"], vst["clip_frac"]


def run_step(step, x):
    """The step and its backward: (loss, stats..., grad logprobs, grad values)."""
    lp = x["logprobs"].detach().clone().requires_grad_(True)
    v = x["values"].detach().clone().requires_grad_(True)
    out = step(**dict(x, logprobs=lp, values=v))
    grads = torch.autograd.grad(out[0], (lp, v))
    return (*out, *grads)
