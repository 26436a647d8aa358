"""Shared by the GPU checks of the fused losses from hidden states (linear_policy_loss,
linear_distill_loss, linear_preference_loss): their timed step, their floor and their profile."""

from __future__ import annotations


def leaves(x):
    """The policy's hidden states and head of the inputs `x`, as leaves that take gradients."""
    return x["h"].detach().requires_grad_(), x["W"].detach().requires_grad_()


def fwd_bwd(h, W):
    """wrap(loss_fn) -> a zero-arg step: the gradients of h and W cleared, loss_fn().backward()."""

    def wrap(f):
        def run():
            h.grad = W.grad = None
            f().backward()

        return run

    return wrap


def four_gemms(h, W, th, tW):
    """The floor of a step with a second head (a teacher's, a reference's): its logits GEMM
    beside the policy's, and the policy's two gradient GEMMs (the logits tile standing in for the
    gradient tile), whole [N, V], cuBLAS, nothing else."""
    h, W = h.detach().flatten(0, -2), W.detach()
    th = th.flatten(0, -2)

    def run():
        z = h @ W.T
        th @ tW.T
        z @ W, z.T @ h

    return run


def profile_fwd_bwd(ctx, op, case, x, loss_fn, device):
    """ctx.profile of one forward + backward of loss_fn(h, W) on x's policy leaves."""
    from gpu_checks._profile import top_kernels

    h, W = leaves(x)
    run = fwd_bwd(h, W)(lambda: loss_fn(h, W))
    ctx.profile(op, case, top_kernels(run, device))
