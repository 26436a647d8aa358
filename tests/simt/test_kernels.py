"""Every CUDA kernel of csrc/cuda, run on the CPU by the SIMT emulator (ppo_kernels._simt) through
the public ops, against the float64 references with the tolerances of the other tests, outputs
NaN-poisoned, under each seed of _simt.SEEDS. Which test reaches which path of the kernels:

token_logprobs (csrc/cuda/token_logprobs.cuh)
  test_token_logprobs            fwd + bwd with entropy, temperature, ignored rows, all dtypes:
      V=1 (32 threads, scalar tail only), V=7 / 9 (head + packs + tail), V=8 (packs only when
      aligned), V=4099 (256 threads for float32, several packs per thread); contiguous rows (the
      guarded buffers start at varied alignments: head loop) and strided rows logits[:, :-1]
      (row starts not 16-byte aligned; the backward's contiguous gradient rows then differ in
      alignment from the logits rows: the scalar-only branch, vec_ok false)
  test_token_logprobs_inplace    inplace backward (gradient written over the logits: same
      alignment, vector branch), logprob-only gradient (no entropy pointer), int32 labels,
      ignore_index inside the vocabulary
  test_token_logprobs_grid_stride   more rows than blocks (max_row_blocks = 3, N prime, 4 warps:
      the block reduction's shared partials reused across rows)
  test_token_logprobs_bad_labels    labels outside the vocabulary give NaN rows (GPU contract)
token_logprobs_sampler (csrc/cuda/token_logprobs_sampler.cuh)
  test_token_logprobs_sampler    fwd (every output) + bwd, bf16, both samplers, each option;
      tests/simt/test_sampler.py holds the rest (all dtypes, ties, strided rows, grid-stride,
      full_kl's per-row temperatures)
full_kl (csrc/cuda/full_kl.cuh)
  test_full_kl                   fwd + bwd for both inputs, with / without mask, V=1, 7, 8, 9,
      4099 (two-packs loop + one-pack remainder), 8209 (1024 threads for float32), strided logits vs contiguous ref (alignments
      differ: the scalar-only branch), all dtypes
  test_full_kl_grid_stride_no_ref_grad   more rows than blocks, masked rows, ref without gradient
gae (csrc/cuda/gae.cuh): sm_count chooses the plan (4 * sm_count target chunks)
  test_gae_single_pass           aligned plan (mode 0): whole rows per chunk, several rows per
      chunk, rows of 2 tiles per chunk; masks, dones, bootstrap, carries, per-token gamma/lam
  test_gae_chunked               chunk maps (mode 1) + carry scan + final pass (mode 2): rows
      spanning several chunks, chunks of 2 tiles, N prime, all dtypes
  test_gae_carry_scan_over_many_chunks   292 chunks: the carry kernel's loop over 256-chunk tiles
  test_gae_packed                packed rows (cu_seqlens: binary search, empty rows, rows across
      chunks), carries
tests/simt/test_cpu_suite.py reruns the CPU suite's edge cases (inf / NaN rows, masks, carries,
...) on the emulated kernels.
linear_token_logprobs (ppo_kernels/fused_linear/chunks.py): on CUDA its whole-vocabulary tiles go
  through the token_logprobs kernels (forward, then the in-place backward over the tile)
  test_linear_token_logprobs     float32 tiles and input-dtype (bf16 / fp16) tiles, fwd + bwd
"""

import pytest
import torch
from support.sampler import SIMT_SETTINGS, simt_case
from support.simt import MARKS, SEEDS, emulated, launches
from support.utils import GRAD_TOL, TOL

import ppo_kernels as pk
from ppo_kernels.gae import naive as GR
from ppo_kernels.linear_logprobs import naive as LR
from ppo_kernels.token_logprobs import naive as TR

pytestmark = MARKS
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got, want, tol):
    torch.testing.assert_close(got.double(), want.double(), **tol, equal_nan=True)


# ---- token_logprobs -------------------------------------------------------------------------


def _tl_inputs(lead, V, dtype, strided, ignore_index=-100):
    if strided:  # logits[:, :-1] of [B, T + 1, V]: rows are V elements apart, one row skipped
        B, T = lead
        logits = (torch.randn(B, T + 1, V) * 3).to(dtype)[:, :-1]
    else:
        logits = (torch.randn(*lead, V) * 3).to(dtype)
    labels = torch.randint(0, V, lead)
    labels[torch.rand(lead) < 0.2] = ignore_index
    return logits, labels


def _tl_ref(logits, labels, T, g_lp, g_ent, ignore_index=-100):
    x = logits.detach().double().requires_grad_()
    lp, ent, _ = TR.forward(x, labels, T, ignore_index)
    loss = (lp * g_lp.double()).sum() + ((ent * g_ent.double()).sum() if g_ent is not None else 0)
    loss.backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lead,V,strided",
    [
        ((3, 5), 1, False),
        ((4, 3), 7, True),
        ((2, 5), 8, False),
        ((3, 3), 9, True),
        ((2, 2), 4099, True),
        ((3,), 4099, False),
        ((2,), 8209, False),
    ],
)
def test_token_logprobs(seed, dtype, lead, V, strided):
    logits, labels = _tl_inputs(lead, V, dtype, strided)
    g_lp, g_ent = torch.randn(lead), torch.randn(lead)
    want_lp, want_ent, want_g = _tl_ref(logits, labels, 0.7, g_lp, g_ent)
    x = logits.detach().requires_grad_()
    with emulated(seed, token_logprobs="cpp"):
        lp, ent = pk.token_logprobs(x, labels, temperature=0.7, return_entropy=True)
        _close(lp, want_lp, TOL[dtype])
        _close(ent, want_ent, TOL[dtype])
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    N, vec = labels.numel(), 16 // logits.element_size()
    threads = max(32, min(1024, 1 << max(0, ((V // vec + 3) // 4 - 1).bit_length())))
    assert launches() == [
        f"token_logprobs fwd_kernel grid={N} block={threads}",
        f"token_logprobs bwd_kernel grid={N} block={threads}",
    ]
    assert x.grad.dtype == dtype
    _close(x.grad, want_g, GRAD_TOL[dtype])
    ignored = labels == -100
    assert (lp[ignored] == 0).all() and (ent[ignored] == 0).all() and (x.grad[ignored] == 0).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_inplace(seed, dtype):
    logits, labels = _tl_inputs((4, 5), 263, dtype, False, ignore_index=3)
    labels = labels.int()
    g_lp = torch.randn(4, 5)
    want_lp, _, want_g = _tl_ref(logits, labels, 1.3, g_lp, None, ignore_index=3)
    x = logits.clone().requires_grad_()
    with emulated(seed, token_logprobs="cpp"):
        y = x * 1  # the op overwrites its input buffer (a non-leaf) with the gradient
        lp = pk.token_logprobs(y, labels, temperature=1.3, ignore_index=3, inplace_backward=True)
        (lp * g_lp).sum().backward()
    _close(lp, want_lp, TOL[dtype])
    _close(x.grad, want_g, GRAD_TOL[dtype])


@pytest.mark.parametrize("seed", SEEDS)
def test_token_logprobs_sampler(seed):
    # V under the block's thread count, half of the settings per seed (the emulator runs a
    # checked row's block in about a second); every option and dtype, ties, strided rows,
    # grid-stride: tests/simt/test_sampler.py
    simt_case(seed, torch.bfloat16, 4, 130, SIMT_SETTINGS[seed % 2 :: 2])


@pytest.mark.parametrize("seed", SEEDS)
def test_token_logprobs_grid_stride(seed):
    # 128 threads (4 warps) per row, ~4 rows per block: the reduction's shared partials are reused
    logits, labels = _tl_inputs((13,), 2003, torch.float32, False)
    g_lp, g_ent = torch.randn(13), torch.randn(13)
    want_lp, want_ent, want_g = _tl_ref(logits, labels, 1.0, g_lp, g_ent)
    x = logits.detach().requires_grad_()
    with emulated(seed, max_row_blocks=3, token_logprobs="cpp"):
        lp, ent = pk.token_logprobs(x, labels, return_entropy=True)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert [e.split()[2] for e in launches()] == ["grid=3", "grid=3"]  # 13 rows, 3 blocks
    _close(lp, want_lp, TOL[torch.float32])
    _close(ent, want_ent, TOL[torch.float32])
    _close(x.grad, want_g, GRAD_TOL[torch.float32])


@pytest.mark.parametrize("seed", SEEDS)
def test_token_logprobs_bad_labels(seed):
    logits, labels = _tl_inputs((6,), 50, torch.float32, False)
    labels[1], labels[4] = 50, -7
    x = logits.detach().requires_grad_()
    with emulated(seed, token_logprobs="cpp"):
        lp, ent = pk.token_logprobs(x, labels, return_entropy=True)
        (lp.nan_to_num().sum() + ent.nan_to_num().sum()).backward()
    bad = torch.zeros(6, dtype=torch.bool)
    bad[1] = bad[4] = True
    assert lp[bad].isnan().all() and ent[bad].isnan().all() and x.grad[bad].isnan().all()
    assert not lp[~bad].isnan().any() and not x.grad[~bad].isnan().any()


# ---- full_kl ---------------------------------------------------------------------------------


def _kl_ref(z, w, T, mask, g):
    z64 = z.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    logp, logq = torch.log_softmax(z64 / T, -1), torch.log_softmax(w64 / T, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    if mask is not None:
        kl = kl * mask
    gz, gw = torch.autograd.grad(kl, (z64, w64), g.double())
    return kl.detach(), gz, gw


KL_TOL = dict(atol=2e-5, rtol=1e-5)  # tests/ops/test_full_kl.py


def _kl_gtol(dtype):
    return dict(atol=2e-6, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-5, rtol=2**-7)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "V,masked", [(1, False), (7, True), (8, False), (9, True), (4099, True), (8209, False)]
)
def test_full_kl(seed, dtype, V, masked):
    N = 3 if V > 1000 else 5
    z = (torch.randn(N, V + 1) * 3).to(dtype)[:, :V]  # strided rows, unaligned starts
    w = (
        (z.float() + 0.3 * torch.randn(N, V)).to(dtype)
        if V % 2
        else (torch.randn(N, V) * 3).to(dtype)
    )
    mask = (torch.arange(N) % 3 != 1) if masked else None
    g = torch.randn(N)
    want, rz, rw = _kl_ref(z, w, 0.7, mask, g)
    zz, ww = z.detach().requires_grad_(), w.detach().requires_grad_()
    with emulated(seed, full_kl="cpp"):
        kl = pk.full_kl(zz, ww, temperature=0.7, mask=mask)
        gz, gw = torch.autograd.grad(kl, (zz, ww), g)
    _close(kl, want, KL_TOL)
    _close(gz, rz, _kl_gtol(dtype))
    _close(gw, rw, _kl_gtol(dtype))


@pytest.mark.parametrize("seed", SEEDS)
def test_full_kl_grid_stride_no_ref_grad(seed):
    N, V = 11, 2003  # 128 threads (4 warps) per row, ~4 rows per block
    z, w = torch.randn(N, V) * 2, torch.randn(N, V) * 2
    mask = torch.rand(N) > 0.3
    g = torch.randn(N)
    want, rz, _ = _kl_ref(z, w, 1.0, mask, g)
    zz = z.clone().requires_grad_()
    with emulated(seed, max_row_blocks=3, full_kl="cpp"):
        kl = pk.full_kl(zz, w, mask=mask)
        (gz,) = torch.autograd.grad(kl, (zz,), g)
    assert [e.split()[2] for e in launches()] == ["grid=3", "grid=3"]  # 11 rows, 3 blocks
    _close(kl, want, KL_TOL)
    _close(gz, rz, _kl_gtol(torch.float32))


# ---- gae -------------------------------------------------------------------------------------

GAE_TOL = dict(atol=2e-5, rtol=2e-5)  # tests/ops/test_gae.py
GAE_LONG_TOL = dict(atol=1e-4, rtol=1e-4)  # rows of thousands of positions with gamma*lam ~ 0.9


def _gae_check(got, ref, tol=GAE_TOL):
    for a, b in (
        (got[0], ref[0]),
        (got[1], ref[1]),
        (got[2][0], ref[2][0]),
        (got[2][1], ref[2][1]),
    ):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, **tol)


def _gae_inputs(shape, dtype=torch.float32):
    r, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    m = torch.rand(shape) > 0.3
    d = torch.rand(shape) > 0.97
    return r, v, m, d


SINGLE = ["gae_chunk_kernel (single pass)"]
CHUNKED = ["gae_chunk_kernel (chunk maps)", "gae_carry_kernel", "gae_chunk_kernel (final)"]


def _gae_plan(log, n_chunks):
    """The kernels launched, checking the chunk count of the chunk passes."""
    for e in log:
        if e.startswith("gae_chunk_kernel"):
            assert f"grid={n_chunks} " in e, log
    return [e.split(" grid=")[0] for e in log]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape,n_chunks", [((5, 900), 3), ((12, 300), 2), ((3, 3001), 3)])
def test_gae_single_pass(seed, shape, n_chunks):
    # sm_count 1: whole rows per chunk when that makes >= 2 chunks. 900: 2 rows per chunk;
    # 300: 6 rows in one tile; 3001: one row of 2 tiles per chunk.
    r, v, m, d = _gae_inputs(shape)
    B, T = shape
    carry = (torch.randn(B), torch.randn(B))
    g = torch.where(torch.arange(T) % 10 == 9, 0.9, 1.0).expand(B, T)
    lam = torch.rand(B, T)
    with emulated(seed, sm_count=1, gae="cpp"):
        got = pk.gae(r, v, m, gamma=0.97, lam=0.9, dones=d, carry=carry, return_carry=True)
        got_t = pk.gae(r, v, m, gamma=g, lam=lam, bootstrap_value=carry[0], return_carry=True)
    assert _gae_plan(launches(), n_chunks) == SINGLE * 2
    ref = GR.gae_sequential(r, v, m, gamma=0.97, lam=0.9, dones=d, carry=carry)
    _gae_check(got, ref, GAE_LONG_TOL)
    ref = GR.gae_sequential(r, v, m, gamma=g, lam=lam, bootstrap_value=carry[0])
    _gae_check(got_t, ref, GAE_LONG_TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,sm", [((1, 9001), 1), ((3, 1657), 4), ((1, 4999), 2)])
def test_gae_chunked(seed, dtype, shape, sm):
    # (1, 9001), sm 1: 3 chunks of 4096 (2 tiles each); (3, 1657), sm 4: 16 target chunks -> 3
    # chunks of 2048 over 3 rows (rows cut by chunk edges); (1, 4999) prime N, sm 2: 3 chunks.
    r, v, m, d = _gae_inputs(shape, dtype)
    B = shape[0]
    bv = torch.randn(B)
    with emulated(seed, sm_count=sm, gae="cpp"):
        got = pk.gae(r, v, m, gamma=0.99, lam=0.95, dones=d, bootstrap_value=bv, return_carry=True)
    assert _gae_plan(launches(), 3) == CHUNKED
    ref = GR.gae_sequential(r, v, m, gamma=0.99, lam=0.95, dones=d, bootstrap_value=bv)
    _gae_check(got, ref, GAE_LONG_TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_carry_scan_over_many_chunks(seed):
    # 199 rows of 3000 with sm_count 100: fewer whole-row chunks (199) than half the target (200),
    # so chunks of 2048 tokens: 292 of them, which the one-block carry kernel scans in two tiles.
    B, T = 199, 3000
    r, v, m, d = _gae_inputs((B, T))
    with emulated(seed, sm_count=100, gae="cpp"):
        got = pk.gae(r, v, m, gamma=0.99, lam=0.95, dones=d, return_carry=True)
    assert _gae_plan(launches(), 292) == CHUNKED
    ref = GR.gae_eager(r.double(), v.double(), m, 0.99, 0.95, d)
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a.double(), b, **GAE_LONG_TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gae_packed(seed, dtype):
    lens = [0, 5, 2100, 1, 0, 3000, 17, 2]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    N = int(cu[-1])
    r, v, m, d = _gae_inputs((N,), dtype)
    n = len(lens)
    carry = (torch.randn(n), torch.randn(n))
    with emulated(seed, sm_count=2, gae="cpp"):
        got = pk.gae(
            r, v, m, gamma=0.95, lam=0.9, dones=d, carry=carry, cu_seqlens=cu, return_carry=True
        )
    assert _gae_plan(launches(), 3) == CHUNKED
    ref = GR.gae_sequential(r, v, m, gamma=0.95, lam=0.9, dones=d, carry=carry, cu_seqlens=cu)
    _gae_check(got, ref, GAE_LONG_TOL)
    for i in (0, 4):  # empty rows hand their carry through
        assert got[2][0][i] == carry[0][i] and got[2][1][i] == carry[1][i]


# ---- linear_token_logprobs ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "dtype,logits_dtype",
    [(torch.float32, "float32"), (torch.bfloat16, "input"), (torch.float16, "input")],
)
def test_linear_token_logprobs(seed, dtype, logits_dtype):
    N, H, V = 10, 16, 523
    h = torch.randn(N, H).to(dtype)
    W = (torch.randn(V, H) / 4).to(dtype)
    b = torch.randn(V).to(dtype)
    labels = torch.randint(0, V, (N,))
    labels[3] = -100
    g_lp, g_ent = torch.randn(N), torch.randn(N)
    # reference: the logits as this path computes them (input-dtype tiles with logits_dtype="input")
    leaves = [t.detach().clone().requires_grad_() for t in (h, W, b)]
    if logits_dtype == "input":
        z = leaves[0] @ leaves[1].T + leaves[2]
        lp_r, ent_r = pk.token_logprobs(z, labels, temperature=0.7, return_entropy=True)
    else:
        lp_r, ent_r = LR.forward(
            *[t.double() for t in leaves[:2]], labels, leaves[2].double(), 0.7
        )[:2]
    ((lp_r * g_lp).sum() + (ent_r * g_ent).sum()).backward()
    ours = [t.detach().clone().requires_grad_() for t in (h, W, b)]
    with emulated(seed, linear_token_logprobs="cpp"):
        lp, ent = pk.linear_token_logprobs(
            ours[0],
            ours[1],
            labels,
            bias=ours[2],
            temperature=0.7,
            return_entropy=True,
            logits_dtype=logits_dtype,
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    _close(lp, lp_r.detach(), dict(atol=2e-5, rtol=2e-5))
    _close(ent, ent_r.detach(), dict(atol=2e-5, rtol=2e-5))
    for t, r in zip(ours, leaves):
        scale = r.grad.float().abs().max().item()
        eps = torch.finfo(dtype).eps
        tol = (
            dict(atol=2e-5, rtol=1e-4)
            if dtype == torch.float32
            else dict(atol=4 * eps * scale, rtol=0)
        )
        _close(t.grad, r.grad, tol)
