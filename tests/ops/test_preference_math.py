"""The preference-loss math (ppo_kernels/losses/preference_math.py) against its float64 autograd
reference on logits (preference_naive.py), against finite differences (gradcheck), and against
the peers' own losses: TRL's DPOTrainer._compute_loss (every loss type and option, on a stand-in
model that returns TRL's fused-head outputs from given logits) and Liger's chunked DPO / ORPO /
SimPO / CPO / KTO losses (CPU, not compiled)."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from support.peer_stubs import import_peer

from ppo_kernels.losses import preference_math as M
from ppo_kernels.losses import preference_naive as NV
from ppo_kernels.losses import preference_unpaired as U

B, T, V = 3, 7, 13


def _cfg(types, weights=None, **kw):
    return M.PreferenceConfig(loss_types=tuple(types), loss_weights=weights, **kw)


def _inputs(seed=0, rows=2 * B, ref=True, close=False):
    """Logits, reference logits (near the logits with `close`: the f-divergence scores
    exponentiate the log-ratios, which overflow for unrelated models) and labels."""
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(rows, T, V, generator=g, dtype=torch.float64)).requires_grad_()
    ref_logits = 2 * torch.randn(rows, T, V, generator=g, dtype=torch.float64) if ref else None
    if close:
        ref_logits = logits.detach() + 0.2 * ref_logits
    labels = torch.randint(0, V, (rows, T), generator=g)
    labels[:, :2] = -100  # the prompt
    labels[0, -2:] = -100  # rows of different lengths
    labels[rows - 1, 3:] = -100
    return logits, ref_logits, labels


def _math_path(cfg, logits, labels, *, ref_logits=None, average=False, ld_alpha=None, wpo=False):
    """(loss, d loss / d logits, metrics) through the analytic math: the sequence log-probs from
    the token log-probs, the math's coefficients, one surrogate backward (what a head term does)."""
    lp, m = NV.token_logprobs(logits, labels)
    k = M.sequence_token_weights(m, average, ld_alpha)
    seq = (k * lp).sum(-1)
    Bp = seq.shape[0] // 2
    rc = rr = None
    if ref_logits is not None:
        rlp, _ = NV.token_logprobs(ref_logits, labels)
        rseq = (k * rlp).sum(-1)
        rc, rr = rseq[:Bp], rseq[Bp:]
    n = m.sum(-1)
    w = None
    if wpo:
        wr = M.wpo_weights(lp, NV.log_sum_sq_probs(logits), m)
        w = wr[:Bp] * wr[Bp:]
    res = M.paired_loss(
        cfg,
        seq[:Bp],
        seq[Bp:],
        rc,
        rr,
        n_chosen=n[:Bp],
        n_rejected=n[Bp:],
        chosen_sum=(lp * m).sum(-1)[:Bp],
        weights=w,
    )
    coef = M.token_coefficients(torch.cat((res.d_chosen, res.d_rejected)), k, res.d_chosen_sum, m)
    (g,) = torch.autograd.grad((coef * lp).sum(), logits)
    return res.loss, g, res.metrics


# every type alone, then the options and combinations the peers run
CASES = [((t,), None, {}, {}) for t in M.TRL_TYPES if t not in ("exo_pair", "robust")]
CASES += [
    (("exo_pair",), None, dict(label_smoothing=1e-3), {}),
    (("robust",), None, dict(label_smoothing=0.1), {}),
    (("aot",), None, dict(label_smoothing=0.2), {}),
    (("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0), {}, {}),  # MPO
    (("sigmoid", "sft"), (1.0, 0.5), {}, dict(ld_alpha=0.3)),  # LD-DPO + RPO's NLL
    (("sigmoid", "sft"), None, {}, dict(wpo=True)),
    (("ipo", "hinge"), None, {}, dict(wpo=True)),
    (("sigmoid",), None, {}, dict(average=True)),
    (("sigmoid",), None, {}, dict(ref=False)),
    (("orpo", "sft"), None, dict(beta=0.2), dict(ref=False, average=True)),
    (("simpo", "sft"), None, dict(simpo_gamma=0.3, label_smoothing=0.1), dict(ref=False)),
    (("cpo",), None, dict(label_smoothing=0.05), dict(ref=False)),
]
for f in ("forward_kl", "js_divergence", "alpha_divergence"):
    for t in ("sigmoid", "sigmoid_norm", "hinge", "ipo", "robust", "discopop"):
        CASES.append(((t,), None, dict(f_divergence_type=f, beta=0.5), {}))
    CASES.append((("exo_pair", "sft"), None, dict(f_divergence_type=f, label_smoothing=0.01), {}))
CASES.append((("sigmoid",), None, dict(f_divergence_type="alpha_divergence", beta=0.3,
                                       f_alpha_divergence_coef=1.5), {}))  # fmt: skip


def _id(case):
    types, w, kw, opt = case
    return "+".join(types) + "".join(f"-{k}={v}" for k, v in {**kw, **opt}.items())


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_math_matches_the_float64_reference(case):
    types, weights, kw, opt = case
    cfg = _cfg(types, weights, **kw)
    use_ref = opt.get("ref", True)
    logits, ref_logits, labels = _inputs(ref=use_ref, close="f_divergence_type" in kw)
    M.check_config(cfg, has_reference=use_ref, has_weights=opt.get("wpo", False))
    args = dict(
        average=opt.get("average", False), ld_alpha=opt.get("ld_alpha"), wpo=opt.get("wpo", False)
    )
    ln, mn = NV.paired_loss(
        cfg,
        logits,
        labels,
        ref_logits=ref_logits,
        average_log_prob=args["average"],
        ld_alpha=args["ld_alpha"],
        use_weighting=args["wpo"],
    )
    (gn,) = torch.autograd.grad(ln, logits)
    lm, gm, mm = _math_path(cfg, logits, labels, ref_logits=ref_logits, **args)
    torch.testing.assert_close(lm, ln.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gm, gn, rtol=1e-10, atol=1e-12)
    for k, v in mn.items():
        torch.testing.assert_close(mm[k], v, rtol=1e-12, atol=1e-12, msg=k)


@pytest.mark.parametrize("case", CASES[:20], ids=[_id(c) for c in CASES[:20]])
def test_float32_math_is_close_to_float64(case):
    types, weights, kw, opt = case
    cfg = _cfg(types, weights, **kw)
    g = torch.Generator().manual_seed(1)
    c, r = -5 - 3 * torch.rand(2, 8, generator=g, dtype=torch.float64)
    rc, rr = c + 0.5 * torch.randn(2, 8, generator=g, dtype=torch.float64)
    n = torch.randint(1, 9, (2, 8), generator=g).double()
    if not opt.get("ref", True):
        rc = rr = None
    r64 = M.paired_loss(cfg, c, r, rc, rr, n_chosen=n[0], n_rejected=n[1])
    f = [None if x is None else x.float() for x in (c, r, rc, rr)]
    r32 = M.paired_loss(cfg, *f, n_chosen=n[0].float(), n_rejected=n[1].float())
    assert r32.loss.dtype == torch.float32 and r32.d_chosen.dtype == torch.float32
    for a, b in (
        (r32.loss, r64.loss),
        (r32.d_chosen, r64.d_chosen),
        (r32.d_rejected, r64.d_rejected),
    ):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=1e-6)


class _MathLoss(torch.autograd.Function):
    """The math's loss with its analytic derivatives as the backward (for gradcheck)."""

    @staticmethod
    def forward(ctx, c, r, cfg, ref, n):
        rc, rr = ref if ref is not None else (None, None)
        res = M.paired_loss(cfg, c, r, rc, rr, n_chosen=n[0], n_rejected=n[1])
        ctx.save_for_backward(res.d_chosen, res.d_rejected)
        return res.loss

    @staticmethod
    def backward(ctx, g):
        dc, dr = ctx.saved_tensors
        return g * dc, g * dr, None, None, None


GRAD_TYPES = [t for t in M.PAIRED_TYPES if t != "sft"]


# the other f-divergences only for the types that have an f-divergence form
@pytest.mark.parametrize(
    "t, f",
    [(t, "reverse_kl") for t in GRAD_TYPES]
    + [(t, "js_divergence") for t in GRAD_TYPES if t in M.F_DIVERGENCE_TYPES],
)
def test_gradcheck_of_the_analytic_derivatives(t, f):
    eps = {"exo_pair": 0.01, "robust": 0.1, "aot": 0.1, "simpo": 0.1}.get(t, 0.0)
    cfg = _cfg((t,), beta=0.7, label_smoothing=eps, f_divergence_type=f)
    g = torch.Generator().manual_seed(2)
    c = (-1 - 2 * torch.rand(6, generator=g, dtype=torch.float64)).requires_grad_()
    r = (-1 - 2 * torch.rand(6, generator=g, dtype=torch.float64)).requires_grad_()
    ref = None
    if t not in M.REFERENCE_FREE_TYPES:
        ref = (c.detach() + 0.3 * torch.randn(6, generator=g, dtype=torch.float64),
               r.detach() + 0.3 * torch.randn(6, generator=g, dtype=torch.float64))  # fmt: skip
    n = torch.randint(1, 6, (2, 6), generator=g).double()
    assert torch.autograd.gradcheck(lambda a, b: _MathLoss.apply(a, b, cfg, ref, n), (c, r))


@pytest.mark.parametrize("types", [("sigmoid",), ("ipo", "sft"), ("nca_pair", "apo_down", "sft")])
def test_blocks_of_pairs_add_up_to_the_batch(types):
    """A pair-scope loss computed block by block (the batch's pair and token counts given) gives
    the whole batch's loss and the same per-pair derivatives: what a fused op's blocks do."""
    cfg = _cfg(types)
    assert M.stat_scope(cfg) == "pair"
    g = torch.Generator().manual_seed(3)
    c, r, rc, rr = -4 * torch.rand(4, 10, generator=g, dtype=torch.float64)
    n = torch.randint(0, 9, (2, 10), generator=g).double()
    P = c * 1.5
    whole = M.paired_loss(cfg, c, r, rc, rr, n_chosen=n[0], n_rejected=n[1], chosen_sum=P)
    total, parts = 0.0, []
    for s in (slice(0, 3), slice(3, 4), slice(4, 10)):
        res = M.paired_loss(cfg, c[s], r[s], rc[s], rr[s], n_chosen=n[0, s], n_rejected=n[1, s],
                            chosen_sum=P[s], num_pairs=10, num_chosen_tokens=n[0].sum())  # fmt: skip
        total = total + res.loss
        parts.append(res)
    torch.testing.assert_close(total, whole.loss)
    torch.testing.assert_close(torch.cat([p.d_chosen for p in parts]), whole.d_chosen)
    torch.testing.assert_close(torch.cat([p.d_rejected for p in parts]), whole.d_rejected)
    if "sft" in types:
        torch.testing.assert_close(torch.cat([p.d_chosen_sum for p in parts]), whole.d_chosen_sum)
    assert M.stat_scope(_cfg(("aot",))) == "batch"
    assert M.stat_scope(_cfg(("sigmoid", "sft")), has_weights=True) == "batch"


def test_no_host_synchronisation():
    """Every type runs on meta tensors (which have no values): no .item(), no data-dependent
    Python branch, so the math traces into one graph."""
    c, r, rc, rr, n = (torch.empty(5, device="meta") for _ in range(5))
    for t in M.PAIRED_TYPES:
        cfg = _cfg((t,), label_smoothing=0.1)
        ref = (None, None) if t in M.REFERENCE_FREE_TYPES else (rc, rr)
        M.paired_loss(cfg, c, r, *ref, n_chosen=n, n_rejected=n, weights=None)
    for t in M.UNPAIRED_TYPES:
        U.unpaired_loss(U.UnpairedConfig(t), c, rc, torch.empty(5, dtype=torch.bool, device="meta"),
                        kl=U.kto_reference_point(r, rr))  # fmt: skip


def test_empty_batch_and_empty_rows():
    cfg = _cfg(("sigmoid", "sft"))
    e = torch.zeros(0, dtype=torch.float64)
    res = M.paired_loss(cfg, e, e, e, e, n_chosen=e, n_rejected=e)
    assert res.loss.item() == 0 and res.d_chosen.shape == (0,)
    # a row without tokens: its mean log-prob is 0, and no chosen token leaves the SFT term 0
    k = M.sequence_token_weights(torch.zeros(2, 4), average=True)
    assert torch.equal(k, torch.zeros(2, 4))
    z = torch.zeros(2, dtype=torch.float64)
    res = M.paired_loss(cfg, z, z, z, z, n_chosen=z, n_rejected=z, chosen_sum=z)
    assert math.isfinite(res.loss.item()) and torch.equal(res.d_chosen_sum, z)


@pytest.mark.parametrize(
    "kw, has_ref, weights, match",
    [
        (dict(loss_types=("dpo",)), True, False, "loss_type: unknown 'dpo'"),
        (dict(loss_types=()), True, False, "loss_type: expected at least one"),
        (dict(loss_types=("sigmoid", "sft"), loss_weights=(1.0,)), True, False, "loss_weights"),
        (dict(beta=0.0), True, False, "beta"),
        (dict(beta=float("nan")), True, False, "beta"),
        (dict(loss_types=("exo_pair",)), True, False, "label_smoothing: exo_pair"),
        (dict(loss_types=("robust",), label_smoothing=0.5), True, False, "label_smoothing: robust"),
        (dict(label_smoothing=1.5), True, False, "label_smoothing"),
        (dict(loss_types=("nca_pair",), f_divergence_type="forward_kl"), True, False,
         "f_divergence_type"),
        (dict(f_divergence_type="kl"), True, False, "f_divergence_type: unknown"),
        (dict(loss_types=("simpo",)), True, False, "ref_chosen"),
        (dict(loss_types=("aot",)), True, True, "weights"),
        (dict(loss_types=("discopop",), discopop_tau=0.0), True, False, "discopop_tau"),
    ],
)  # fmt: skip
def test_bad_configurations_name_the_option(kw, has_ref, weights, match):
    with pytest.raises(ValueError, match=match):
        M.check_config(M.PreferenceConfig(**kw), has_ref, weights)


def test_bad_unpaired_configurations_name_the_option():
    with pytest.raises(ValueError, match="loss_type: unknown 'bco'"):
        U.check_unpaired_config(U.UnpairedConfig("bco"))
    with pytest.raises(ValueError, match="beta"):
        U.check_unpaired_config(U.UnpairedConfig("kto", beta=-1.0))
    with pytest.raises(ValueError, match="ld_alpha"):
        M.sequence_token_weights(torch.ones(2, 3), average=True, ld_alpha=0.5)
    with pytest.raises(ValueError, match="mask: ld_alpha"):
        M.sequence_token_weights(torch.ones(3, 3), ld_alpha=0.5)


# ---- unpaired (KTO) ----


@pytest.mark.parametrize("t", M.UNPAIRED_TYPES)
@pytest.mark.parametrize("kl", [None, 0.4])
def test_unpaired_math_matches_the_float64_reference(t, kl):
    cfg = U.UnpairedConfig(t, beta=0.3, desirable_weight=1.3, undesirable_weight=0.7)
    logits, ref_logits, labels = _inputs(seed=4, rows=5)
    y = torch.tensor([True, False, True, True, False])
    ln, mn = NV.unpaired_loss(cfg, logits, labels, y, ref_logits=ref_logits, kl=kl)
    (gn,) = torch.autograd.grad(ln, logits)
    lp, m = NV.token_logprobs(logits, labels)
    rlp, _ = NV.token_logprobs(ref_logits, labels)
    seq = (lp * m).sum(-1)
    res = U.unpaired_loss(cfg, seq, (rlp * m).sum(-1), y, kl=kl)
    (gm,) = torch.autograd.grad((res.d_logps.unsqueeze(-1) * m * lp).sum(), logits)
    torch.testing.assert_close(res.loss, ln.detach())
    torch.testing.assert_close(gm, gn)
    for k, v in mn.items():
        torch.testing.assert_close(res.metrics[k], v, msg=k)


def test_unpaired_gradcheck_and_reference_point():
    cfg = U.UnpairedConfig("kto", beta=0.8, desirable_weight=2.0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.rand(7, generator=g) > 0.4

    class F_(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            res = U.unpaired_loss(cfg, x, None, y, kl=0.2)
            ctx.save_for_backward(res.d_logps)
            return res.loss

        @staticmethod
        def backward(ctx, gr):
            return gr * ctx.saved_tensors[0]

    assert torch.autograd.gradcheck(F_.apply, (x,))
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 3.5])
    assert U.kto_reference_point(a, b).item() == 0.0  # clamped at 0
    assert U.kto_reference_point(b, a).item() == 1.25


# ---- TRL's DPOTrainer, its own loss code ----


class _TRLModel(torch.nn.Module):
    """Stands in for a causal LM with TRL's fused head: returns its FusedCausalLMOutput (log-probs,
    entropy, log sum p^2, mean logits, top-1) computed from given next-token logits [R, L-1, V]."""

    def __init__(self, logits, out_cls):
        super().__init__()
        self.logits, self.out_cls = logits, out_cls

    def forward(self, input_ids=None, labels=None, fused_lm_head=False, **_):
        lab = labels[:, 1:]
        keep = lab != -100
        logp = torch.log_softmax(self.logits, -1)
        lp = logp.gather(-1, lab.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        z = torch.zeros((), dtype=lp.dtype)
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)
            lssp = torch.logsumexp(2 * logp, -1)
            top1 = logp.argmax(-1) == lab
        return self.out_cls(
            log_probs=torch.where(keep, lp, z),
            entropy=torch.where(keep, ent, z),
            log_sum_sq_probs=torch.where(keep, lssp, z),
            mean_logits=torch.where(keep, self.logits.detach().mean(-1), z),
            is_top1=top1 & keep,
            label_mask=keep,
        )


def _trl_self(trainer_cls, model, **opts):
    acc = SimpleNamespace(
        device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x
    )
    s = SimpleNamespace(
        model=model,
        accelerator=acc,
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
        args=SimpleNamespace(
            discopop_tau=opts.pop("discopop_tau", 0.05), gradient_checkpointing_kwargs=None
        ),
    )
    for k, v in opts.items():
        setattr(s, k, v)
    return s


@pytest.fixture(scope="module")
def trl():
    dpo = import_peer("trl.trainer.dpo_trainer")
    utils = import_peer("trl.trainer.utils")
    return dpo, utils


TRL_CASES = [((t,), None, {}, {}) for t in M.TRL_TYPES if t not in ("exo_pair", "robust")]
TRL_CASES += [
    (("exo_pair",), None, dict(label_smoothing=1e-3), {}),
    (("robust",), None, dict(label_smoothing=0.1), {}),
    (("aot_unpaired",), None, dict(label_smoothing=0.3), {}),
    (("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0), {}, {}),
    (("sigmoid", "sft"), None, {}, dict(ld_alpha=0.4)),
    # TRL 1.16's use_weighting scales the per-pair loss in place: sft raises (an expanded value)
    # and hinge's backward fails (relu's saved output modified); the math runs them
    (("ipo", "sigmoid"), None, {}, dict(use_weighting=True)),
    (("sigmoid",), None, dict(f_divergence_type="js_divergence"), {}),
    (("sigmoid_norm",), None, dict(f_divergence_type="forward_kl"), {}),
    (("hinge", "discopop"), (1.0, 2.0), dict(f_divergence_type="alpha_divergence"), {}),
]


@pytest.mark.parametrize("case", TRL_CASES, ids=[_id(c) for c in TRL_CASES])
def test_matches_trl_dpo_trainer(trl, case):
    dpo, utils = trl
    types, weights, kw, opt = case
    cfg = _cfg(types, weights, beta=0.4, **kw)
    g = torch.Generator().manual_seed(6)
    L = T + 1
    input_ids = torch.randint(0, V, (2 * B, L), generator=g)
    cm = torch.zeros(2 * B, L, dtype=torch.long)
    for i, n in enumerate([5, 6, 3, 4, 6, 2]):  # prompt of 2, then n completion tokens
        cm[i, 2 : 2 + n] = 1
    # TRL's alpha-divergence clamp has no float64 entry: that case runs in float32
    dt = torch.float32 if cfg.f_divergence_type == "alpha_divergence" else torch.float64
    logits = (2 * torch.randn(2 * B, L - 1, V, generator=g, dtype=dt)).requires_grad_()
    labels = input_ids[:, 1:].masked_fill(cm[:, 1:] == 0, -100)
    # reference sequence log-probs near the policy's (the f-divergence scores exponentiate them)
    lp0, m0 = NV.token_logprobs(logits.detach(), labels)
    ref = (lp0 * m0).sum(-1) + 0.5 * torch.randn(2 * B, generator=g, dtype=torch.float64)
    ref = ref.to(dt).view(2, B)
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  completion_mask=cm, ref_chosen_logps=ref[0], ref_rejected_logps=ref[1])  # fmt: skip
    model = _TRLModel(logits, utils.FusedCausalLMOutput)
    me = _trl_self(
        dpo.DPOTrainer,
        model,
        beta=cfg.beta,
        loss_types=list(types),
        loss_weights=list(cfg.weights),
        ld_alpha=opt.get("ld_alpha"),
        f_divergence_type=cfg.f_divergence_type,
        f_alpha_divergence_coef=cfg.f_alpha_divergence_coef,
        label_smoothing=cfg.label_smoothing,
        use_weighting=opt.get("use_weighting", False),
    )
    loss_trl = dpo.DPOTrainer._compute_loss(me, model, inputs, False)
    (g_trl,) = torch.autograd.grad(loss_trl, logits)
    # the math path with the reference as given sequence log-probs (TRL's precomputed path)
    lp, m = NV.token_logprobs(logits, labels)
    k = M.sequence_token_weights(m, ld_alpha=opt.get("ld_alpha"))
    seq = (k * lp).sum(-1)
    n = m.sum(-1)
    w = None
    if opt.get("use_weighting"):
        wr = M.wpo_weights(lp, NV.log_sum_sq_probs(logits), m)
        w = wr[:B] * wr[B:]
    res = M.paired_loss(cfg, seq[:B], seq[B:], ref[0].double(), ref[1].double(), n_chosen=n[:B],
                        n_rejected=n[B:], chosen_sum=(lp * m).sum(-1)[:B], weights=w)  # fmt: skip
    coef = M.token_coefficients(torch.cat((res.d_chosen, res.d_rejected)), k, res.d_chosen_sum, m)
    (g_ours,) = torch.autograd.grad((coef * lp).sum(), logits)
    tol = {} if dt == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(res.loss.to(dt), loss_trl.detach(), **tol)
    torch.testing.assert_close(g_ours, g_trl, **tol)
    logged = me._metrics["train"]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected"):  # fmt: skip
        a = 1e-9 if dt == torch.float64 else 2e-5  # TRL's float32 log-ratio cancels
        assert res.metrics[key].item() == pytest.approx(logged[key][-1], rel=1e-6, abs=a), key


# ---- Liger's chunked losses (CPU, not compiled) ----


H = 6


def _hidden(seed, rows=2 * B, ref=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, T, H, generator=g).requires_grad_()
    W = (0.5 * torch.randn(V, H, generator=g)).requires_grad_()
    bias = (0.1 * torch.randn(V, generator=g)).requires_grad_()
    rh, rW, rb = torch.randn(rows, T, H, generator=g), torch.randn(V, H, generator=g), None
    labels = torch.randint(0, V, (rows, T), generator=g)
    labels[:, :2] = -100
    labels[1, 5:] = -100
    labels[rows - 1, 4:] = -100
    return h, W, bias, (rh, rW, rb) if ref else None, labels


def _ours_from_hidden(cfg, h, W, bias, ref, labels, average):
    """(loss, grads of h, W, bias, metrics): the math path on float64 logits of the same head."""
    h64, W64, b64 = (x.detach().double().requires_grad_() for x in (h, W, bias))
    logits = h64 @ W64.T + b64
    lp, m = NV.token_logprobs(logits, labels)
    k = M.sequence_token_weights(m, average)
    seq = (k * lp).sum(-1)
    Bp = seq.shape[0] // 2
    rc = rr = None
    if ref is not None:
        rh, rW, _ = ref
        rlp, _ = NV.token_logprobs(rh.double() @ rW.double().T, labels)
        rseq = (k * rlp).sum(-1)
        rc, rr = rseq[:Bp], rseq[Bp:]
    n = m.sum(-1)
    res = M.paired_loss(cfg, seq[:Bp], seq[Bp:], rc, rr, n_chosen=n[:Bp], n_rejected=n[Bp:],
                        chosen_sum=(lp * m).sum(-1)[:Bp])  # fmt: skip
    coef = M.token_coefficients(torch.cat((res.d_chosen, res.d_rejected)), k, res.d_chosen_sum, m)
    grads = torch.autograd.grad((coef * lp).sum(), (h64, W64, b64))
    return res.loss, grads, res.metrics


def _close32(ours, theirs, what):
    torch.testing.assert_close(
        ours.float(), theirs.detach().float(), rtol=1e-5, atol=2e-6, msg=what
    )


LIGER_DPO = sorted(["sigmoid", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                    "apo_zero", "apo_down", "discopop"])  # fmt: skip


@pytest.mark.parametrize("t", LIGER_DPO)
@pytest.mark.parametrize("nll, average", [(False, False), (True, True)])
def test_matches_liger_dpo(t, nll, average):
    dpo = import_peer("liger_kernel.chunked_loss.dpo_loss")
    eps = {"exo_pair": 1e-3, "robust": 0.1}.get(t, 0.0)
    h, W, bias, ref, labels = _hidden(7)
    mod = dpo.LigerFusedLinearDPOLoss(beta=0.3, alpha=0.7, compute_nll_loss=nll, compiled=False,
                                      average_log_prob=average, loss_type=t, label_smoothing=eps,
                                      chunk_size=2)  # fmt: skip
    loss, aux = mod(W, h, labels, bias, ref[0], ref[1], ref[2])
    gh, gW, gb = torch.autograd.grad(loss, (h, W, bias))
    types, weights = ((t, "sft"), (1.0, 0.7)) if nll else ((t,), None)
    cfg = _cfg(types, weights, beta=0.3, label_smoothing=eps)
    ours, (oh, oW, ob), met = _ours_from_hidden(cfg, h, W, bias, ref, labels, average)
    _close32(ours, loss, "loss")
    for a, b, w in ((oh, gh, "hidden"), (oW, gW, "weight"), (ob, gb, "bias")):
        _close32(a, b, w)
    _close32(met["chosen_rewards"], aux[5], "chosen rewards")
    _close32(met["rejected_rewards"], aux[6], "rejected rewards")
    if nll:
        _close32(met["nll_loss"], aux[4], "nll")


@pytest.mark.parametrize("t", ["orpo", "simpo", "cpo"])
@pytest.mark.parametrize("nll", [False, True])
def test_matches_liger_reference_free(t, nll):
    mods = {"orpo": ("orpo_loss", "LigerFusedLinearORPOLoss"),
            "simpo": ("simpo_loss", "LigerFusedLinearSimPOLoss"),
            "cpo": ("cpo_loss", "LigerFusedLinearCPOLoss")}  # fmt: skip
    lib = import_peer(f"liger_kernel.chunked_loss.{mods[t][0]}")
    cls = getattr(lib, mods[t][1])
    h, W, bias, _, labels = _hidden(8, ref=False)
    kw = dict(beta=0.25, compute_nll_loss=nll, compiled=False, chunk_size=2)
    if t != "orpo":
        kw.update(alpha=0.6, label_smoothing=0.1)
    if t == "simpo":
        kw["gamma"] = 0.4
    mod = cls(**kw)
    out = mod(W, h, labels, bias)
    loss, aux = out
    gh, gW, gb = torch.autograd.grad(loss, (h, W, bias))
    average = t in ("orpo", "simpo")  # Liger's defaults (cpo sums)
    alpha = 1.0 if t == "orpo" else 0.6
    types, weights = ((t, "sft"), (1.0, alpha)) if nll else ((t,), None)
    cfg = _cfg(types, weights, beta=0.25, label_smoothing=0.0 if t == "orpo" else 0.1,
               simpo_gamma=0.4)  # fmt: skip
    ours, (oh, oW, ob), met = _ours_from_hidden(cfg, h, W, bias, None, labels, average)
    _close32(ours, loss, "loss")
    for a, b, w in ((oh, gh, "hidden"), (oW, gW, "weight"), (ob, gb, "bias")):
        _close32(a, b, w)
    _close32(met["chosen_rewards"], aux[5], "chosen rewards")
    if t == "orpo":
        _close32(met["log_odds_ratio"], aux[7], "log odds ratio")
        _close32(met["log_odds_chosen"], aux[8], "log odds chosen")


@pytest.mark.parametrize("use_ref, kl", [(True, 0.3), (True, None), (False, None)])
def test_matches_liger_kto(use_ref, kl):
    kto = import_peer("liger_kernel.chunked_loss.kto_loss")
    rows = 5
    h, W, bias, ref, labels = _hidden(9, rows=rows, ref=use_ref)
    y = torch.tensor([True, False, False, True, True])
    mod = kto.LigerFusedLinearKTOLoss(beta=0.2, compiled=False, use_ref_model=use_ref, chunk_size=2)
    klt = None if kl is None else torch.tensor(kl)
    loss, aux = mod(h, W, labels, bias, y, *(ref if use_ref else (None, None, None)), klt)
    gh, gW, gb = torch.autograd.grad(loss, (h, W, bias))
    h64, W64, b64 = (x.detach().double().requires_grad_() for x in (h, W, bias))
    lp, m = NV.token_logprobs(h64 @ W64.T + b64, labels)
    seq = (lp * m).sum(-1)
    refseq = None
    if use_ref:
        rlp, _ = NV.token_logprobs(ref[0].double() @ ref[1].double().T, labels)
        refseq = (rlp * m).sum(-1)
    res = U.unpaired_loss(U.UnpairedConfig("kto", beta=0.2), seq, refseq, y, kl=kl)
    grads = torch.autograd.grad((res.d_logps.unsqueeze(-1) * m * lp).sum(), (h64, W64, b64))
    _close32(res.loss, loss, "loss")
    for a, b, w in zip(grads, (gh, gW, gb), ("hidden", "weight", "bias")):
        _close32(a, b, w)
    _close32(res.metrics["chosen_logps_sum"], aux[0], "chosen logps sum")
    _close32(res.metrics["chosen_rewards_sum"], aux[4], "chosen rewards sum")
    _close32(res.metrics["rejected_rewards_sum"], aux[5], "rejected rewards sum")
