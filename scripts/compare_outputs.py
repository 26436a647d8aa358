"""A fixed set of calls of every public op, forward and backward, on every CPU backend, saved so
that two commits can be compared bit for bit (a refactor must not change a single bit).

    python scripts/compare_outputs.py record OUT.pt     # at each commit (PYTHONPATH=checkout)
    python scripts/compare_outputs.py compare A.pt B.pt

Only the public API is called, so the script runs unchanged at both commits. Every output and
every gradient is kept; `compare` reports each call whose tensors differ in any bit (NaN equal to
NaN) or whose set of outputs changed, and exits 1 if any did.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PPO_KERNELS_LOGITS_DTYPE", "float32")

import torch  # noqa: E402


def _flat(prefix, x, out):
    if isinstance(x, torch.Tensor):
        out[prefix] = x.detach().clone()
    elif isinstance(x, dict):
        for k in sorted(x):
            _flat(f"{prefix}.{k}", x[k], out)
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            _flat(f"{prefix}[{i}]", v, out)
    elif hasattr(x, "_asdict"):
        _flat(prefix, x._asdict(), out)
    elif hasattr(x, "__dataclass_fields__"):
        _flat(prefix, {k: getattr(x, k) for k in x.__dataclass_fields__}, out)
    elif isinstance(x, (int, float, bool)) or x is None:
        out[prefix] = torch.tensor(float("nan") if x is None else float(x), dtype=torch.float64)


def _backward(out, leaves):
    """Sum of every floating output that requires grad, backward; the leaves' gradients."""
    total = None
    stack = [out]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.requires_grad and x.is_floating_point():
                s = torch.where(torch.isfinite(x), x, torch.zeros_like(x)).sum()
                total = s if total is None else total + s
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
    if total is None:
        return {}
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return {f"grad{i}": g for i, g in enumerate(grads) if g is not None}


def calls():
    """(name, fn) pairs; fn() returns (output, leaves to differentiate)."""
    import ppo_kernels as pk

    out = []

    def add(name, fn):
        out.append((name, fn))

    def g(seed):
        return torch.Generator().manual_seed(seed)

    def logits(N, V, dt=torch.float32, seed=0, grad=True):
        return (torch.randn(N, V, generator=g(seed)) * 3).to(dt).requires_grad_(grad)

    for dt in (torch.float32, torch.bfloat16, torch.float64):
        for ent in (False, True):
            for temp in (1.0, 0.7):

                def f(dt=dt, ent=ent, temp=temp):
                    z = logits(37, 101, dt)
                    lab = torch.randint(0, 101, (37,), generator=g(1))
                    lab[3] = -100
                    return pk.token_logprobs(z, lab, temperature=temp, return_entropy=ent), [z]

                add(f"token_logprobs/{dt}/ent={ent}/t={temp}", f)

    for dt in (torch.float32, torch.bfloat16, torch.float64):
        for kw in (
            {},
            {"return_entropy": True},
            {"return_entropy": True, "temperature": 0.8, "softcap": 5.0},
            {"return_entropy": True, "max_chunk_bytes": 4096},
            {"return_entropy": True, "logits_dtype": "input"},
            {"return_entropy": True, "bias": True},
        ):
            if kw.get("logits_dtype") == "input" and dt != torch.bfloat16:
                continue

            def f(dt=dt, items=tuple(kw.items())):
                kw = dict(items)
                h = torch.randn(2, 19, 24, generator=g(2)).to(dt).requires_grad_()
                w = (torch.randn(97, 24, generator=g(3)) * 0.3).to(dt).requires_grad_()
                lab = torch.randint(0, 97, (2, 19), generator=g(4))
                lab[0, 2] = -100
                leaves = [h, w]
                if kw.pop("bias", False):
                    b = torch.randn(97, generator=g(5)).to(dt).requires_grad_()
                    kw["bias"] = b
                    leaves.append(b)
                return pk.linear_token_logprobs(h, w, lab, **kw), leaves

            add(f"linear_token_logprobs/{dt}/{sorted(kw)}", f)

    for dt in (torch.float32, torch.float64):
        for mask in (False, True):

            def f(dt=dt, mask=mask):
                z, zr = logits(23, 64, dt, 6), logits(23, 64, dt, 7, grad=False)
                m = (torch.rand(23, generator=g(8)) > 0.3) if mask else None
                return pk.full_kl(z, zr, temperature=0.9, mask=m), [z]

            add(f"full_kl/{dt}/mask={mask}", f)

    def lp_inputs(B=4, T=13, seed=10, dt=torch.float32):
        lp = (-torch.rand(B, T, generator=g(seed)) * 3).to(dt).requires_grad_()
        old = (lp.detach() + 0.2 * torch.randn(B, T, generator=g(seed + 1)).to(dt)).to(dt)
        ref = (lp.detach() + 0.3 * torch.randn(B, T, generator=g(seed + 2)).to(dt)).to(dt)
        adv = torch.randn(B, T, generator=g(seed + 3)).to(dt)
        mask = torch.rand(B, T, generator=g(seed + 4)) > 0.25
        mask[:, 0] = True
        return lp, old, ref, adv, mask

    for est in ("k1", "k2", "k3", "abs", "k3+"):
        for clamp in ("none", "verl", "openrlhf"):

            def f(est=est, clamp=clamp):
                lp, old, ref, adv, mask = lp_inputs()
                return pk.kl_penalty(lp, ref, est, clamp=clamp), [lp]

            add(f"kl_penalty/{est}/{clamp}", f)

    for conv in ("verl", "openrlhf"):

        def f(conv=conv):
            lp, old, ref, adv, mask = lp_inputs()
            scores = torch.randn(4, generator=g(20))
            return pk.kl_penalized_rewards(
                scores, lp.detach(), ref, mask, beta=0.05, estimator="k3", convention=conv
            ), []

        add(f"kl_penalized_rewards/{conv}", f)

    for kw in (
        {},
        {"gamma": 0.99, "lam": 0.95},
        {"gamma": 0.9, "lam": 0.8, "dones": True},
        {"gamma": 0.9, "lam": 0.8, "bootstrap": True},
        {"nomask": True, "gamma": 0.97},
    ):

        def f(items=tuple(kw.items())):
            kw = dict(items)
            B, T = 3, 17
            r = torch.randn(B, T, generator=g(30)) * 0.1
            v = torch.randn(B, T, generator=g(31))
            m = torch.rand(B, T, generator=g(32)) > 0.3
            if kw.pop("dones", False):
                kw["dones"] = torch.rand(B, T, generator=g(33)) > 0.9
            if kw.pop("bootstrap", False):
                kw["bootstrap_value"] = torch.randn(B, generator=g(34))
            if kw.pop("nomask", False):
                m = None
            return pk.gae(r, v, m, **kw), []

        add(f"gae/{sorted(kw)}", f)

    def f_packed():
        r = torch.randn(40, generator=g(35))
        v = torch.randn(40, generator=g(36))
        m = torch.rand(40, generator=g(37)) > 0.2
        cu = torch.tensor([0, 7, 20, 40], dtype=torch.int32)
        return pk.gae(r, v, m, gamma=0.95, lam=0.9, cu_seqlens=cu), []

    add("gae/packed", f_packed)

    for unbiased in (True, False):

        def f(unbiased=unbiased):
            x = torch.randn(5, 33, generator=g(40), requires_grad=True)
            m = torch.rand(5, 33, generator=g(41)) > 0.4
            return pk.masked_whiten(x, m, unbiased=unbiased), [x]

        add(f"masked_whiten/unbiased={unbiased}", f)
    for dim in (None, 1):

        def f(dim=dim):
            x = torch.randn(5, 33, generator=g(42), requires_grad=True)
            m = torch.rand(5, 33, generator=g(43)) > 0.4
            return pk.masked_mean(x, m, dim), [x]

        add(f"masked_mean/dim={dim}", f)

    for agg in (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ):

        def f(agg=agg):
            x = torch.randn(4, 21, generator=g(44), requires_grad=True)
            m = torch.rand(4, 21, generator=g(45)) > 0.3
            return pk.masked_aggregate(x, m, agg), [x]

        add(f"masked_aggregate/{agg}", f)

    from ppo_kernels.losses import policy_math as pm

    for lt in pm.LOSS_TYPES:
        for level in ("token", "sequence"):
            if level == "sequence" and lt not in ("ppo", "grpo"):
                continue

            def f(lt=lt, level=level):
                lp, old, ref, adv, mask = lp_inputs(seed=50)
                ent = torch.rand(4, 13, generator=g(59), requires_grad=True)
                kw = {}
                if lt == "dro":
                    kw["dro_beta"] = 0.1
                if lt in ("clip_cov", "kl_cov"):
                    kw["generator"] = g(60)
                return pk.ppo_policy_loss(
                    lp, old, adv, mask, loss_type=lt, importance_sampling_level=level,
                    entropy=ent, **kw,
                ), [lp, ent]  # fmt: skip

            add(f"ppo_policy_loss/{lt}/{level}", f)

    for kw in ({"dual_clip": 3.0}, {"clip_high": 0.28, "agg": "seq-mean-token-mean"}):

        def f(kw=kw):
            lp, old, ref, adv, mask = lp_inputs(seed=61)
            return pk.ppo_policy_loss(lp, old, adv, mask, **kw), [lp]

        add(f"ppo_policy_loss/ppo/{sorted(kw)}", f)

    for rc in (
        {"rollout_is": "token", "rollout_is_threshold": 2.0},
        {"rollout_is": "sequence", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"},
        {"rollout_is": "token", "bypass_mode": True},
        {
            "rollout_is": "sequence",
            "rollout_rs": "seq_mean_k3",
            "rollout_rs_threshold": 0.5,
            "bypass_mode": True,
        },
    ):

        def f(rc=rc):
            lp, old, ref, adv, mask = lp_inputs(seed=62)
            roll = old + 0.1 * torch.randn(4, 13, generator=g(63))
            if rc.get("bypass_mode"):  # old_logprobs are the rollout's
                return pk.ppo_policy_loss(lp, roll, adv, mask, **rc), [lp]
            return pk.ppo_policy_loss(lp, old, adv, mask, rollout_logprobs=roll, **rc), [lp]

        add(f"ppo_policy_loss/rollout/{sorted(rc.items())}", f)

    for clip in (None, 0.2):

        def f(clip=clip):
            v = torch.randn(4, 13, generator=g(70), requires_grad=True)
            ov = torch.randn(4, 13, generator=g(71))
            ret = torch.randn(4, 13, generator=g(72))
            m = torch.rand(4, 13, generator=g(73)) > 0.3
            return pk.ppo_value_loss(v, ov, ret, m, clip=clip), [v]

        add(f"ppo_value_loss/clip={clip}", f)

    for norm in (True, False):

        def f(norm=norm):
            s = torch.randn(12, generator=g(80))
            s[4:8] = 1.0
            return pk.grpo_advantages(s, group_size=4, norm_by_std=norm), []

        add(f"grpo_advantages/norm={norm}", f)

    def f_gi():
        s = torch.randn(10, generator=g(81))
        gi = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 3, 3])
        return (pk.grpo_advantages(s, gi), pk.rloo_advantages(s, gi)), []

    add("group_advantages/group_index", f_gi)
    add(
        "rloo_advantages/size",
        lambda: (pk.rloo_advantages(torch.randn(12, generator=g(82)), group_size=3), []),
    )

    def f_pair():
        c = torch.randn(9, generator=g(90), requires_grad=True)
        r = torch.randn(9, generator=g(91), requires_grad=True)
        rc_, rr = torch.randn(9, generator=g(92)), torch.randn(9, generator=g(93))
        return (pk.reward_model_loss(c, r), pk.dpo_loss(c, r, rc_, rr, beta=0.1)), [c, r]

    add("pairwise", f_pair)

    # the fused hidden-state policy loss: every loss type, and the options its loop branches on
    def lpl(kw, dt=torch.float32, seed=100, B=3, T=11, H=16, V=83):
        def f():
            kw2 = dict(kw)
            h = torch.randn(B, T, H, generator=g(seed)).to(dt).requires_grad_()
            w = (torch.randn(V, H, generator=g(seed + 1)) * 0.3).to(dt).requires_grad_()
            lab = torch.randint(0, V, (B, T), generator=g(seed + 2))
            old = -torch.rand(B, T, generator=g(seed + 3)) * 4 - 1
            adv = torch.randn(B, T, generator=g(seed + 4))
            m = torch.rand(B, T, generator=g(seed + 5)) > 0.25
            m[:, 0] = True
            leaves = [h, w]
            if kw2.pop("ref", False):
                kw2["ref_logprobs"] = old + 0.2 * torch.randn(B, T, generator=g(seed + 6))
            if kw2.pop("ref_head", False):
                kw2["ref_hidden"] = torch.randn(B, T, H, generator=g(seed + 7)).to(dt)
                kw2["ref_weight"] = (torch.randn(V, H, generator=g(seed + 8)) * 0.3).to(dt)
            if kw2.pop("bias", False):
                b = torch.randn(V, generator=g(seed + 9)).to(dt).requires_grad_()
                kw2["bias"] = b
                leaves.append(b)
            if kw2.pop("roll", False):
                roll = old + 0.1 * torch.randn(B, T, generator=g(seed + 10))
                if kw2.get("bypass_mode"):  # old_logprobs are the rollout's
                    old = roll
                else:
                    kw2["rollout_logprobs"] = roll
            if kw2.pop("seq_adv", False):
                adv = torch.randn(B, generator=g(seed + 11))
            if kw2.get("loss_type") in ("clip_cov", "kl_cov"):
                kw2["generator"] = g(seed + 12)
            if kw2.get("loss_type") == "dro":
                kw2["dro_beta"] = 0.1
            return pk.linear_policy_loss(h, w, lab, adv, old, m, **kw2), leaves

        return f

    for lt in pm.LOSS_TYPES:
        add(f"linear_policy_loss/{lt}", lpl({"loss_type": lt}))
        add(
            f"linear_policy_loss/{lt}/kl+ent",
            lpl({"loss_type": lt, "ref": True, "kl_coef": 0.05, "entropy_coef": 0.01}),
        )
    for name, kw in (
        ("seq-level", {"importance_sampling_level": "sequence"}),
        ("seq-level-small-chunk", {"importance_sampling_level": "sequence", "max_chunk_bytes": 2000}),
        ("gspo-small-chunk", {"loss_type": "gspo", "max_chunk_bytes": 2000}),
        ("seq-adv", {"seq_adv": True, "loss_type": "grpo"}),
        ("full-kl", {"ref_head": True, "kl_coef": 0.1, "entropy_coef": 0.02}),
        ("bias-temp-softcap", {"bias": True, "temperature": 0.7, "softcap": 4.0}),
        ("dual-clip", {"dual_clip": 3.0, "clip_high": 0.28}),
        ("agg", {"agg": "seq-mean-token-sum-norm", "ref": True, "kl_coef": 0.1}),
        ("rollout", {"roll": True, "rollout_is": "token", "rollout_rs": "seq_mean_k3",
                     "rollout_rs_threshold": 0.5}),
        ("bypass", {"roll": True, "rollout_is": "token", "bypass_mode": True}),
        ("bypass-seq", {"roll": True, "rollout_is": "sequence", "bypass_mode": True}),
        ("bypass-rs", {"roll": True, "rollout_rs": "token_k2", "rollout_rs_threshold": 0.3,
                       "bypass_mode": True}),
        ("small-chunk", {"max_chunk_bytes": 3000, "ref": True, "kl_coef": 0.05}),
        ("kl-est", {"ref": True, "kl_coef": 0.05, "kl_estimator": "k1+", "kl_clamp": "verl"}),
        ("global", {"global_num_tokens": 40, "dp_size": 2}),
    ):  # fmt: skip
        add(f"linear_policy_loss/{name}", lpl(kw))
    for dt in (torch.bfloat16, torch.float64):
        add(f"linear_policy_loss/ppo/{dt}", lpl({"ref": True, "kl_coef": 0.05}, dt=dt))
        add(f"linear_policy_loss/gspo/{dt}", lpl({"loss_type": "gspo"}, dt=dt))
    add(
        "linear_policy_loss/bf16-input-tiles",
        lpl({"logits_dtype": "input", "entropy_coef": 0.01}, dt=torch.bfloat16),
    )
    # the vocab-parallel forms on a one-rank gloo group (their code paths; the merge across ranks
    # is tests/ops' business)
    import torch.distributed as dist

    if not dist.is_initialized():
        import tempfile

        store = tempfile.NamedTemporaryFile(delete=False).name  # no port to collide on
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    pg = dist.group.WORLD

    def vp_tl():
        z = logits(17, 50, seed=120)
        lab = torch.randint(0, 50, (17,), generator=g(121))
        return pk.token_logprobs(z, lab, return_entropy=True, process_group=pg), [z]

    def vp_ltl():
        h = torch.randn(17, 12, generator=g(122), requires_grad=True)
        w = torch.randn(50, 12, generator=g(123), requires_grad=True)
        lab = torch.randint(0, 50, (17,), generator=g(124))
        return pk.linear_token_logprobs(h, w, lab, return_entropy=True, process_group=pg), [h, w]

    def vp_fk():
        z, zr = logits(17, 50, seed=125), logits(17, 50, seed=126, grad=False)
        return pk.full_kl(z, zr, process_group=pg), [z]

    add("vocab_parallel/token_logprobs", vp_tl)
    add("vocab_parallel/linear_token_logprobs", vp_ltl)
    add("vocab_parallel/full_kl", vp_fk)
    for name, kw in (("ppo", {"ref": True, "kl_coef": 0.05, "entropy_coef": 0.01}),
                     ("gspo", {"loss_type": "gspo"}), ("full-kl", {"ref_head": True, "kl_coef": 0.1})):  # fmt: skip
        add(f"vocab_parallel/linear_policy_loss/{name}", lpl({**kw, "process_group": pg}))
    return out


def _backends():
    import ppo_kernels as pk
    from ppo_kernels import _backend

    yield "default", pk.use_backend
    yield "eager", lambda: pk.use_backend("eager")
    if _backend.HAS_TRITON:
        yield "triton", lambda: pk.use_backend("triton")


def record(path):
    import ppo_kernels as pk

    torch.set_num_threads(1)
    result = {}
    for mode in ("default", "invariant"):
        for bname, ctx in _backends():
            if bname == "triton" and mode == "invariant":
                continue
            for name, fn in calls():
                if bname == "triton" and not name.startswith(
                    ("token_logprobs", "linear_token_logprobs", "full_kl", "kl_", "gae")
                ):
                    continue  # the interpreter is slow: the ops whose kernels are Triton's own
                key = f"{mode}/{bname}/{name}"
                try:
                    inv = pk.batch_invariant() if mode == "invariant" else _null()
                    with ctx(), inv:
                        out, leaves = fn()
                        flat = {}
                        _flat("out", out, flat)
                        _flat("grad", _backward(out, leaves), flat)
                except Exception as e:  # noqa: BLE001  (a failure is an outcome to compare too)
                    flat = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
                result[key] = flat
    torch.save(result, path)
    print(f"{len(result)} calls recorded in {path}")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    return bool(torch.equal(a, b))


def compare(pa, pb):
    A, B = torch.load(pa), torch.load(pb)
    bad = []
    for k in sorted(set(A) | set(B)):
        if k not in A or k not in B:
            bad.append(f"{k}: only in {'A' if k in A else 'B'}")
            continue
        a, b = A[k], B[k]
        if set(a) != set(b):
            bad.append(f"{k}: outputs {sorted(set(a) ^ set(b))} in one only")
            continue
        for n in a:
            if not _same(a[n], b[n]):
                bad.append(f"{k}: {n} differs")
    n_err = sum("error" in v for v in A.values())
    print(f"{len(A)} calls in A ({n_err} raised, compared as messages), {len(B)} in B")
    if bad:
        print("\n".join(bad))
        print(f"{len(bad)} differences")
        return 1
    print("bitwise equal")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        print(__doc__)
        sys.exit(2)
