// Modes that cross the Python / C++ boundary by name: the raw kernels' schemas take strings, and
// the position of a name in its table is the enum value the kernels switch on. The Python tables
// (ppo_kernels/_modes.py) are checked against these by tests/test_contract.py through the op
// `ppo_kernels_C::mode_names`, so the two sides cannot drift apart.
#pragma once

#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace ppo_kernels {

// Loss aggregation over the mask (verl's agg_loss modes): loss_math / losses.cpp.
enum Agg : int64_t { kTokenMean = 0, kSeqMeanTokenSum, kSeqMeanTokenMean, kSeqMeanTokenSumNorm };
inline const std::vector<std::string>& agg_names() {
  static const std::vector<std::string> names = {"token-mean", "seq-mean-token-sum",
                                                 "seq-mean-token-mean", "seq-mean-token-sum-norm"};
  return names;
}

// Sampled-token KL estimators (canonical names; the Python API also takes verl's aliases).
// Order = KLEstimator in kl_stats.h.
inline const std::vector<std::string>& kl_estimator_names() {
  static const std::vector<std::string> names = {"k1", "abs", "k2", "k3"};
  return names;
}

// Policy-loss types whose per-token loss is ppo's clipped surrogate (policy_math.CLIP_TYPES): at
// token level and without delta, the fused loss kernels compute them (loss_math.h policy_token;
// the types differ in the aggregation and the log-ratio clamp, resolved before the kernels).
inline const std::vector<std::string>& clip_loss_type_names() {
  static const std::vector<std::string> names = {"ppo", "grpo", "bnpo", "dr_grpo", "dapo", "luspo"};
  return names;
}

// Group-relative advantage estimators.
enum GroupAdvantage : int64_t { kGRPO = 0, kRLOO };
inline const std::vector<std::string>& group_advantage_names() {
  static const std::vector<std::string> names = {"grpo", "rloo"};
  return names;
}

// Reductions of the pairwise (reward-model / DPO) loss.
enum Reduction : int64_t { kReduceMean = 0, kReduceSum, kReduceNone };
inline const std::vector<std::string>& reduction_names() {
  static const std::vector<std::string> names = {"mean", "sum", "none"};
  return names;
}

// The index of `name` in `names`, or a clear error naming the argument and the choices.
inline int64_t mode_index(const char* arg, const std::vector<std::string>& names,
                          const std::string& name) {
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return static_cast<int64_t>(i);
  }
  std::string choices;
  for (const auto& n : names) choices += (choices.empty() ? "" : ", ") + n;
  TORCH_CHECK_VALUE(false, arg, ": unknown mode '", name, "'; expected one of ", choices);
  return -1;
}

}  // namespace ppo_kernels
