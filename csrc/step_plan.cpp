// step_plan.cpp — next uses from the last step (see step_plan.h).
#include "step_plan.h"

#include "step_trace.h"

#include <algorithm>
#include <limits>

namespace pymem {

void StepPlan::build(const StepArrays& s) {
  const size_t n = s.op.size(), m = s.value_bytes.size();
  op_ = s.op;
  inputs_start_ = s.inputs_start;
  outputs_start_ = s.outputs_start;
  inputs_ = s.inputs;
  value_bytes_ = s.value_bytes;
  output_bytes_.clear();
  output_bytes_.reserve(s.outputs.size());
  for (int32_t v : s.outputs) output_bytes_.push_back(s.value_bytes[static_cast<size_t>(v)]);
  // Uses by value, by counting (positions come out ascending: ops are walked in order).
  use_start_.assign(m + 1, 0);
  for (int32_t v : s.inputs) ++use_start_[static_cast<size_t>(v) + 1];
  for (size_t v = 0; v < m; ++v) use_start_[v + 1] += use_start_[v];
  uses_.assign(s.inputs.size(), 0);
  std::vector<int64_t> fill(use_start_.begin(), use_start_.end() - 1);
  for (size_t k = 0; k < n; ++k)
    for (int64_t i = s.inputs_start[k]; i < s.inputs_start[k + 1]; ++i)
      uses_[static_cast<size_t>(fill[static_cast<size_t>(s.inputs[static_cast<size_t>(i)])]++)] = static_cast<int32_t>(k);
  before_.assign(n + 1, 0.0);
  for (size_t k = 0; k < n; ++k) before_[k + 1] = before_[k] + s.op_cost[k];
}

bool StepPlan::matches(const StepArrays& s, size_t k) const {
  if (k >= op_.size() || s.op[k] != op_[k]) return false;
  const auto ins = [](const std::vector<int64_t>& start, size_t k) { return std::make_pair(start[k], start[k + 1]); };
  const auto [a0, a1] = ins(s.inputs_start, k);
  const auto [b0, b1] = ins(inputs_start_, k);
  if (a1 - a0 != b1 - b0 || !std::equal(s.inputs.begin() + a0, s.inputs.begin() + a1, inputs_.begin() + b0))
    return false;
  const auto [c0, c1] = ins(s.outputs_start, k);
  const auto [d0, d1] = ins(outputs_start_, k);
  if (c1 - c0 != d1 - d0) return false;
  for (int64_t i = 0; i < c1 - c0; ++i)
    if (s.value_bytes[static_cast<size_t>(s.outputs[static_cast<size_t>(c0 + i)])] !=
        output_bytes_[static_cast<size_t>(d0 + i)])
      return false;
  return true;
}

double StepPlan::seconds_to_next_use(int32_t v, size_t k) const {
  if (v < 0 || static_cast<size_t>(v) >= value_bytes_.size()) return -1.0;
  const auto first = uses_.begin() + use_start_[static_cast<size_t>(v)];
  const auto last = uses_.begin() + use_start_[static_cast<size_t>(v) + 1];
  const auto next = std::lower_bound(first, last, static_cast<int32_t>(std::min(k, op_.size())));
  if (next == last) return std::numeric_limits<double>::infinity();
  return before_[static_cast<size_t>(*next)] - before_[std::min(k, op_.size())];
}

}  // namespace pymem
