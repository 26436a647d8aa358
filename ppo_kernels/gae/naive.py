"""GAE references: the semantics, the `eager` backend and the benchmark baselines.

Semantics (the GAE section of ppo-math.md), per row, with the carry (nv0, A0) flowing in from the
right edge (nv0 = bootstrap_value or carry[0], default 0; A0 = carry[1], default 0):
  * only action positions (mask != 0) take part; n(t) is the next action of the same episode;
  * dones[u] ends the episode right after u: nothing flows from the right of u into u and the
    positions before it (an action at u gets V_next = 0 and A_next = 0, whatever the row's
    bootstrap value; a done at a masked position cuts the same way);
  * past the last action of the row (with no done in between) V_next = nv0 and A_next = A0;
  * delta[t] = r[t] + gamma[t] * V_next(t) - V[t];  A[t] = delta[t] + gamma[t] * lam[t] * A_next(t)
  * a masked position t carries the next action's advantage: A[t] = A_next(t) (A0, or 0 past a
    done); returns[t] = A[t] + V[t] at every position;
  * the left-edge carry of a row is (V_next, A_next) as seen from just before its first position,
    so processing a row in chunks right to left, feeding each chunk the carry of the chunk after
    it, equals processing it whole;
  * packed rows (cu_seqlens): independent rows of one flat sequence; an empty row passes its
    carry through unchanged.
Documented edge cases: a NaN/inf reward or value at an action position propagates to the left
until the next done (the kernels' scan form may also carry it across a done: 0 * inf); a NaN value
at a masked position only affects returns there (the recursion skips it). An empty time axis
([B, 0], or packed N = 0), with float or per-token gamma / lam (e.g. a [B, 1] tensor alone),
gives empty outputs and passes every row's carry through. Bad arguments (a bootstrap_value that is
not a tensor, a string gamma, wrong shapes) raise TypeError / ValueError naming the argument.
"""

from __future__ import annotations

import torch

from .._math import acc_dtype


def _rows(n_rows, row_len, cu_seqlens):
    if cu_seqlens is None:
        return [(i * row_len, (i + 1) * row_len) for i in range(n_rows)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def gae_sequential(
    rewards,
    values,
    mask=None,
    *,
    gamma=1.0,
    lam=1.0,
    dones=None,
    bootstrap_value=None,
    cu_seqlens=None,
    carry=None,
):
    """Float64, one position at a time, straight from the formulas with n(t) found explicitly (the
    test oracle: slow, for small inputs). Returns (advantages, returns, (carry_value, carry_adv))."""
    shape = rewards.shape
    r = rewards.detach().double().flatten().tolist()
    v = values.detach().double().flatten().tolist()
    N = len(r)
    m = [True] * N if mask is None else [bool(x) for x in (mask != 0).flatten().tolist()]
    d = [False] * N if dones is None else [bool(x) for x in dones.flatten().tolist()]

    def per_token(x):
        if isinstance(x, torch.Tensor):
            return x.detach().double().expand(shape).flatten().tolist()
        return [float(x)] * N

    g, lm = per_token(gamma), per_token(lam)
    n_rows = (cu_seqlens.numel() - 1) if cu_seqlens is not None else shape[0]
    row_len = shape[-1] if cu_seqlens is None else None
    nv0 = [0.0] * n_rows
    a0 = [0.0] * n_rows
    if bootstrap_value is not None:
        nv0 = bootstrap_value.double().tolist()
    if carry is not None:
        nv0, a0 = carry[0].double().tolist(), carry[1].double().tolist()
    adv = [0.0] * N
    cv, ca = [0.0] * n_rows, [0.0] * n_rows
    for row, (lo, hi) in enumerate(_rows(n_rows, row_len, cu_seqlens)):

        def nxt(t):
            """(next action of the same episode or None, episode ended before reaching it)."""
            for u in range(t, hi):
                if u > t and m[u]:
                    return u, False
                if d[u]:
                    return None, True
            return None, False

        for t in range(hi - 1, lo - 1, -1):
            n, ended = nxt(t)
            if n is not None:
                v_next, a_next = v[n], adv[n]
            elif ended:
                v_next, a_next = 0.0, 0.0
            else:
                v_next, a_next = nv0[row], a0[row]
            if m[t]:
                delta = r[t] + g[t] * v_next - v[t]
                adv[t] = delta + g[t] * lm[t] * a_next
            else:
                adv[t] = a_next
        # The left-edge carry: what a position just before the row would see.
        first = next((u for u in range(lo, hi) if m[u] or d[u]), None)
        if first is None:
            cv[row], ca[row] = nv0[row], a0[row]
        elif m[first]:  # (a done at that action itself only cuts what lies to its right)
            cv[row], ca[row] = v[first], adv[first]
        else:  # a done before any action
            cv[row], ca[row] = 0.0, 0.0
    A = torch.tensor(adv, dtype=torch.float64).reshape(shape)
    ret = A + values.detach().double()
    return A, ret, (torch.tensor(cv, dtype=torch.float64), torch.tensor(ca, dtype=torch.float64))


def gae_eager(
    rewards,
    values,
    mask=None,
    gamma=1.0,
    lam=1.0,
    dones=None,
    init_value=None,
    init_adv=None,
    cu_seqlens=None,
):
    """The eager backend: verl's loop over time, vectorised over rows, extended with dones,
    per-token gamma/lam, the right-edge carry and packed rows (right-aligned into a padded batch).
    Float64 inputs compute in float64, everything else in float32 (in verl's operation order).
    Returns (advantages, returns, carry_value, carry_adv)."""
    acc = acc_dtype(rewards.dtype)
    if cu_seqlens is not None:
        return _eager_packed(
            rewards, values, mask, gamma, lam, dones, init_value, init_adv, cu_seqlens, acc
        )
    B, T = rewards.shape
    r, v = rewards.to(acc), values.to(acc)
    nv = init_value.to(acc).clone() if init_value is not None else r.new_zeros(B)
    A = init_adv.to(acc).clone() if init_adv is not None else r.new_zeros(B)
    tg = isinstance(gamma, torch.Tensor)
    g = gamma.to(acc).expand(B, T) if tg else gamma
    gl = (gamma.to(acc) * lam.to(acc)).expand(B, T) if tg else gamma * lam
    m = None if mask is None else mask != 0
    adv = torch.empty(B, T, dtype=acc, device=r.device)
    zero = r.new_zeros(B)
    for t in reversed(range(T)):
        if dones is not None:
            nv = torch.where(dones[:, t], zero, nv)
            A = torch.where(dones[:, t], zero, A)
        gt = g[:, t] if tg else g
        delta = r[:, t] + gt * nv - v[:, t]
        An = delta + (gl[:, t] if tg else gl) * A
        if m is None:
            nv, A = v[:, t], An
        else:
            nv = torch.where(m[:, t], v[:, t], nv)
            A = torch.where(m[:, t], An, A)
        adv[:, t] = A
    return adv, adv + v, nv, A


def _eager_packed(rewards, values, mask, gamma, lam, dones, init_value, init_adv, cu_seqlens, acc):
    cu = cu_seqlens.long().cpu()
    lens = (cu[1:] - cu[:-1]).tolist()
    L = max(lens, default=0)
    dev = rewards.device
    # Right-align each row in an [n, L] batch: left padding is masked, never done (identity).
    col = torch.arange(L)
    pos = cu[:-1, None] + col[None, :] - (L - torch.tensor(lens, dtype=torch.long))[:, None]
    valid = col[None, :] >= (L - torch.tensor(lens, dtype=torch.long))[:, None]
    idx = torch.where(valid, pos, torch.zeros_like(pos)).to(dev)
    valid = valid.to(dev)

    def pad(x, fill):
        if x is None:
            return None
        return torch.where(valid, x[idx], torch.full((), fill, dtype=x.dtype, device=dev))

    m = pad(mask if mask is not None else torch.ones_like(rewards, dtype=torch.bool), False)
    g = pad(gamma, 1.0) if isinstance(gamma, torch.Tensor) else gamma
    lm = pad(lam, 1.0) if isinstance(lam, torch.Tensor) else lam
    adv, _, cv, ca = gae_eager(
        pad(rewards, 0.0), pad(values, 0.0), m, g, lm, pad(dones, False), init_value, init_adv
    )
    out = torch.empty(rewards.shape, dtype=acc, device=dev)
    out[idx[valid]] = adv[valid]
    return out, out + values.to(acc), cv, ca


# ---- peers' loops (benchmark baselines and parity tests), written from their semantics ----


def verl_gae_loop(token_level_rewards, values, response_mask, gamma, lam, bootstrap_value=None):
    """verl's compute_gae_advantage_return before its whitening: masked positions are skipped,
    carrying the next action's value and advantage (13 tensor ops per step). `bootstrap_value`
    [B] (not in verl, which always starts from 0): V after each row's last action, for rows
    truncated by the response budget (the trainer's `--ops eager` passes it)."""
    nextvalues = 0 if bootstrap_value is None else bootstrap_value
    lastgaelam = 0
    out = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, advantages + values


def openrlhf_gae_loop(values, rewards, action_mask, gamma, lam):
    """OpenRLHF's get_advantages_and_returns: rewards and values zeroed outside the action mask,
    then the plain recursion (masked positions are zero-reward, zero-value steps)."""
    lastgaelam = 0
    out = []
    T = rewards.size(1)
    values = action_mask * values
    rewards = action_mask * rewards
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        out.append(lastgaelam)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages.detach(), (advantages + values).detach()


def trl_gae_loop(rewards, values, gamma, lam):
    """TRL's PPO trainer loop: no mask (the caller has zeroed padding), plain recursion."""
    lastgaelam = 0
    out = []
    T = rewards.shape[1]
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        out.append(lastgaelam)
    advantages = torch.stack(out[::-1], axis=1)
    return advantages, advantages + values
