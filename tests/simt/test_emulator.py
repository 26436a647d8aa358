"""The SIMT emulator itself (csrc/testing/): small correct kernels give the right answer under
every seed, and each deliberately broken kernel (csrc/testing/simt_selftest.cpp) is caught, by the
check the test names."""

import pytest
import torch
from support.simt import MARKS

pytestmark = MARKS
SEEDS = (0, 1, 2, 3)


def run(name, x, seed, blocks=1):
    torch.ops.ppo_kernels_simt.set_seed(seed)
    return torch.ops.ppo_kernels_simt.selftest(name, x, blocks)


@pytest.mark.parametrize("seed", SEEDS)
def test_correct_kernels(seed):
    x = torch.randn(3 * 128 - 5)
    # shuffles (down) + shared partials + barrier, three blocks in a shuffled order
    got = run("warp_sum", x, seed, blocks=3)
    want = torch.nn.functional.pad(x, (0, 5)).view(3, 128).sum(1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # cub::BlockScan (exclusive, with aggregate), __shfl_sync, __ballot_sync
    got = run("block_scan", x, seed, blocks=3)
    xp = torch.nn.functional.pad(x, (0, 5)).view(3, 128)
    excl = (xp.cumsum(1) - xp).flatten()[: x.numel()]
    torch.testing.assert_close(got[: x.numel()], excl, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[x.numel() :], xp.sum(1), atol=1e-4, rtol=1e-5)
    # the barrier-correct version of the broken kernel below is order-independent
    x = torch.randn(256)
    a = run("reuse_race_ok", x, seed)
    t = torch.arange(128)
    want = x[(t + 1) % 128] + 2 * x[128 + (t + 1) % 128]
    torch.testing.assert_close(a, want)


@pytest.mark.parametrize("seed", SEEDS)
def test_missing_syncthreads_is_caught_by_the_random_fiber_order(seed):
    # Without the barrier between a round's reads and the next round's writes, a thread scheduled
    # after its neighbour reads the neighbour's next-round value.
    x = torch.randn(256)
    t = torch.arange(128)
    want = x[(t + 1) % 128] + 2 * x[128 + (t + 1) % 128]
    got = run("reuse_race", x, seed)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("seed", SEEDS)
def test_shared_read_before_write_is_caught_by_the_nan_fill(seed):
    got = run("read_unwritten", torch.randn(128), seed)
    assert got[:64].isnan().all() and not got[64:].isnan().any()


def test_off_by_one_global_read_is_caught_by_the_guard_page():
    # The buffer abuts its guard page at the end (or, at random, at the start: then the read lands
    # in the slack and goes unseen), so some of the suite's seeds must catch it.
    caught = []
    for seed in SEEDS:
        try:
            run("off_by_one_read", torch.randn(100), seed)
        except RuntimeError as e:
            assert "SIMT[memory]" in str(e) and "past the end" in str(e), str(e)
            assert "off_by_one_read" in str(e) and "thread (99,0,0)" in str(e), str(e)
            caught.append(seed)
    assert caught, "no seed caught the out-of-bounds read"


@pytest.mark.parametrize("seed", SEEDS)
def test_off_by_one_global_write_is_caught_by_guard_page_or_canary(seed):
    with pytest.raises(RuntimeError, match=r"SIMT\[memory\].*(past the end|write)"):
        run("off_by_one_write", torch.randn(100), seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_shuffle_with_a_lane_missing_is_caught_by_the_mask_check(seed):
    with pytest.raises(RuntimeError, match=r"SIMT\[shuffle\].*lane 31"):
        run("shuffle_lane_missing", torch.randn(128), seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_divergent_barrier_is_caught_by_the_barrier_check(seed):
    with pytest.raises(RuntimeError, match=r"SIMT\[barrier\]"):
        run("divergent_barrier", torch.randn(128), seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_threads_at_different_barriers_are_caught_by_the_barrier_check(seed):
    with pytest.raises(
        RuntimeError, match=r"SIMT\[barrier\] thread reached __syncthreads at .* while"
    ):
        run("split_barrier", torch.randn(128), seed)


def test_shared_memory_and_block_size_limits():
    with pytest.raises(
        RuntimeError, match=r"SIMT\[shared\] kernel too_much_shared uses 52000 bytes"
    ):
        run("too_much_shared", torch.randn(128), 0)
    with pytest.raises(RuntimeError, match=r"SIMT\[launch\] kernel block_too_large: block \(2048"):
        run("block_too_large", torch.randn(128), 0)


@pytest.mark.parametrize(
    "kernel", ["token_logprobs_fwd", "token_logprobs_bwd", "full_kl_fwd", "full_kl_bwd", "gae_fwd"]
)
def test_emulated_kernels_have_the_compiled_kernels_schemas(kernel):
    simt = str(getattr(torch.ops.ppo_kernels_simt, kernel).default._schema)
    real = str(getattr(torch.ops.ppo_kernels_C, kernel).default._schema)
    assert simt.replace("ppo_kernels_simt::", "") == real.replace("ppo_kernels_C::", "")
