"""Test helpers: NaN-poisoning and the documented tolerances."""
import torch

# Tolerances of a float32-accumulating kernel against the float64 reference, per input dtype:
# the inputs are rounded to the dtype first (so the reference sees the same values), leaving only
# float32 accumulation error; gradients are rounded to the input dtype on output.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-5, rtol=2e-5),
}
GRAD_TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-4),
    torch.bfloat16: dict(atol=1e-4, rtol=1.6e-2),  # output rounding to bf16: 2^-8 relative
    torch.float16: dict(atol=1e-6, rtol=2e-3),     # output rounding to fp16: 2^-11 relative
}


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a tensor with NaN (floats) or a sentinel (ints) so unwritten output shows."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(-12345)


def poison_empty(monkeypatch):
    """Make torch.empty / empty_like / new_empty return NaN-filled tensors for the test's
    duration, so any output element a kernel forgets to write is NaN, not stale memory."""
    real_empty, real_like = torch.empty, torch.empty_like

    def empty(*a, **k):
        return poison(real_empty(*a, **k))

    def empty_like(*a, **k):
        return poison(real_like(*a, **k))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
