// GAE as an affine scan, shared by the CPU (csrc/cpu/gae.cpp) and CUDA (csrc/cuda/gae.cu) kernels.
// Semantics: ppo_kernels/gae/naive.py and the GAE section of ppo-math.md.
//
// A row is processed right to left carrying the state s = (nv, adv): nv is the value of the next
// action position (or the bootstrap value / 0 past the last action), adv that action's advantage.
// One position t maps the state coming from its right to the state it leaves to its left:
//   done[t]:   s = (0, 0) first (the episode ends right after t: nothing flows in from the right)
//   action:    adv = r + g*nv - v + g*l*adv,  nv = v        (verl's recursion)
//   masked:    s unchanged (skipped; its outputs carry the next action's advantage)
// and outputs adv[t] = s.adv, returns[t] = s.adv + v[t] with s the state after t.
//
// Every such map is affine and lower-triangular in (nv, adv):
//   F(nv, adv) = (p*nv + cv,  q*nv + m*adv + ca)
// and maps of this form are closed under composition, so a chunk of a row composes to one GaeMap
// (5 floats): chunks are reduced independently and the carries fixed up afterwards, which is
// exactly what processing the row whole gives (up to float rounding).
#pragma once

#include "common/macros.h"

namespace ppo_kernels {

struct GaeState {
  float nv;   // value of the next action position (what V_next is for the position to the left)
  float adv;  // advantage of the next action position
};

struct GaeMap {
  float p, q, m, cv, ca;  // (nv, adv) -> (p*nv + cv, q*nv + m*adv + ca)
};

PPO_HD GaeMap gae_identity() { return {1.f, 0.f, 1.f, 0.f, 0.f}; }

// The constant map that sets the state to s (a row's right edge: bootstrap value and carry).
PPO_HD GaeMap gae_constant(GaeState s) { return {0.f, 0.f, 0.f, s.nv, s.adv}; }

PPO_HD GaeState gae_apply(const GaeMap& f, GaeState s) {
  return {f.p * s.nv + f.cv, f.q * s.nv + f.m * s.adv + f.ca};
}

// `first` applied first (the positions to the right), then `then` (the positions to its left).
// Associative, not commutative: this is the combine of the scan, in right-to-left order.
PPO_HD GaeMap gae_compose(const GaeMap& first, const GaeMap& then) {
  return {then.p * first.p, then.q * first.p + then.m * first.q, then.m * first.m,
          then.p * first.cv + then.cv, then.q * first.cv + then.m * first.ca + then.ca};
}

// The map of one position. g and l are gamma[t] and lam[t].
PPO_HD GaeMap gae_element(bool action, bool done, float r, float v, float g, float l) {
  const float k = done ? 0.f : 1.f;
  if (action) return {0.f, g * k, g * l * k, v, r - v};
  return {k, 0.f, k, 0.f, 0.f};
}

// One sequential step, in the exact operation order of verl's loop
// (delta = r + gamma * nextvalues - v; adv = delta + (gamma * lam) * lastgaelam).
// gl is gamma * lam (for scalar gamma and lam computed in double and rounded once, as Python does).
// Written with selects, not branches: masks and dones are data-dependent and a mispredicted
// branch costs more than computing both sides.
PPO_HD GaeState gae_step(GaeState s, bool action, bool done, float r, float v, float g, float gl) {
  const float nv = done ? 0.f : s.nv;
  const float a = done ? 0.f : s.adv;
  const float delta = (r + g * nv) - v;
  const float an = delta + gl * a;
  return {action ? v : nv, action ? an : a};
}

}  // namespace ppo_kernels
