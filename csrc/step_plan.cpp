// step_plan.cpp — next uses from the last step (see step_plan.h).
#include "step_plan.h"

#include <algorithm>
#include <limits>

namespace pymem {

void StepPlan::build(const StepArrays& s, Releases how, const StepArrays& learned_from,
                     const std::vector<std::pair<int32_t, int32_t>>& cover, std::vector<Hold> holds) {
  index(s);
  how_ = how;
  set_releases(covers(how)                ? cover
               : how == Releases::kLearned ? learned(learned_from)
                                           : std::vector<std::pair<int32_t, int32_t>>());
  if (how != Releases::kRebuild) holds.clear();  // the one way that plans what reruns rebuild
  set_holds(std::move(holds));
}

std::vector<StepPlan::Hold> StepPlan::retained(const StepArrays& s, int64_t retain_limit, const std::vector<Hold>& before) {
  const size_t n = s.op.size(), m = s.value_bytes.size();
  std::vector<Hold> out;
  if (s.value_free_at.size() != m || s.value_overwrites.size() != m || retain_limit <= 0) return out;
  std::vector<uint8_t> may(m, 0);  // freed by the program after its producer, small, recomputable, not overwritten
  for (size_t v = 0; v < m; ++v) {
    const int32_t f = s.value_free_at[v], p = s.value_producer[v];
    may[v] = p >= 0 && f >= p && static_cast<size_t>(f) < n && s.value_recomputable[v] && s.value_bytes[v] <= retain_limit;
  }
  for (int32_t w : s.value_overwrites)
    if (w >= 0) may[static_cast<size_t>(w)] = 0;
  std::vector<int32_t> until(m, -1);
  const auto in_step = [&](int32_t v) { return v >= 0 && static_cast<size_t>(v) < m && may[static_cast<size_t>(v)]; };
  for (size_t i = 0; i < s.back_at.size(); ++i) {  // comebacks after the program's free
    const int32_t v = s.back_value[i], at = s.back_at[i];
    if (in_step(v) && at > s.value_free_at[static_cast<size_t>(v)] && static_cast<size_t>(at) < n)
      until[static_cast<size_t>(v)] = std::max(until[static_cast<size_t>(v)], at);
  }
  for (const Hold& h : before) {  // held before, left alone by pressure: held again
    if (!in_step(h.value) || h.from != s.value_free_at[static_cast<size_t>(h.value)] || static_cast<size_t>(h.until) >= n)
      continue;
    bool released = false;
    for (size_t i = 0; i < s.released_at.size() && !released; ++i)
      released = s.released_value[i] == h.value && h.from < s.released_at[i] && s.released_at[i] <= h.until;
    if (!released) until[static_cast<size_t>(h.value)] = std::max(until[static_cast<size_t>(h.value)], h.until);
  }
  for (size_t v = 0; v < m; ++v)
    if (until[v] >= 0) out.push_back({static_cast<int32_t>(v), s.value_free_at[v], until[v]});
  return out;
}

void StepPlan::set_holds(std::vector<Hold> holds) {
  const size_t n = step_.op.size(), m = step_.value_bytes.size();
  holds.erase(std::remove_if(holds.begin(), holds.end(), [&](const Hold& h) {
                return h.value < 0 || static_cast<size_t>(h.value) >= m || h.from < 0 || h.until <= h.from ||
                       static_cast<size_t>(h.until) >= n;
              }), holds.end());
  holds_ = std::move(holds);
  const auto index_by = [&](auto position, std::vector<int64_t>& start, std::vector<int32_t>& values) {
    std::vector<std::pair<int32_t, int32_t>> at;  // (position, value)
    for (const Hold& h : holds_) at.emplace_back(position(h), h.value);
    std::sort(at.begin(), at.end());
    start.assign(n + 1, 0);
    values.clear();
    for (const auto& [k, v] : at) {
      ++start[static_cast<size_t>(k) + 1];
      values.push_back(v);
    }
    for (size_t k = 0; k < n; ++k) start[k + 1] += start[k];
  };
  index_by([](const Hold& h) { return h.from; }, hold_start_, hold_);
  index_by([](const Hold& h) { return h.until; }, let_go_start_, let_go_);
}

void StepPlan::index(const StepArrays& s) {
  const size_t n = s.op.size(), m = s.value_bytes.size();
  step_ = s;
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

std::vector<std::pair<int32_t, int32_t>> StepPlan::learned(const StepArrays& from) const {
  const StepArrays& s = step_;
  const size_t n = s.op.size(), m = s.value_bytes.size();
  // Early releases, by position. A value that came back before its next use (a recompute read it)
  // is needed where the plan sees no use: not released early.
  std::vector<std::vector<int32_t>> back(m);
  for (size_t i = 0; i < from.back_at.size(); ++i)
    if (from.back_value[i] >= 0 && static_cast<size_t>(from.back_value[i]) < m)
      back[static_cast<size_t>(from.back_value[i])].push_back(from.back_at[i]);
  std::vector<std::pair<int32_t, int32_t>> due;  // (position, value)
  for (size_t i = 0; i < from.released_at.size(); ++i) {
    const int32_t p = from.released_at[i], v = from.released_value[i];
    if (v < 0 || static_cast<size_t>(v) >= m || !s.value_recomputable[static_cast<size_t>(v)]) continue;
    const auto first = uses_.begin() + use_start_[static_cast<size_t>(v)];
    const auto last = uses_.begin() + use_start_[static_cast<size_t>(v) + 1];
    const auto next = std::lower_bound(first, last, p);  // uses at or after p
    const int32_t u = next != first ? *(next - 1) : s.value_producer[static_cast<size_t>(v)];
    // Only across a long stretch (forward activations waiting for backward): nearer uses are left
    // to pressure, which may then keep the value for a recompute the plan does not see.
    const int32_t q = next == last ? static_cast<int32_t>(n) : *next;
    const double away = next == last ? std::numeric_limits<double>::infinity() : before_[static_cast<size_t>(q)];
    const auto& b = back[static_cast<size_t>(v)];
    if (std::any_of(b.begin(), b.end(), [&](int32_t at) { return p <= at && at < q; })) continue;
    if (u >= 0 && u < p && away - before_[static_cast<size_t>(u)] >= kLongStretch * before_[n]) due.emplace_back(u, v);
  }
  return due;
}

void StepPlan::set_releases(std::vector<std::pair<int32_t, int32_t>> due) {
  const size_t n = step_.op.size(), m = step_.value_bytes.size();
  std::sort(due.begin(), due.end());
  due.erase(std::unique(due.begin(), due.end()), due.end());
  due.erase(std::remove_if(due.begin(), due.end(), [&](const auto& d) {
              return d.first < 0 || static_cast<size_t>(d.first) >= n || d.second < 0 || static_cast<size_t>(d.second) >= m;
            }), due.end());
  due_start_.assign(n + 1, 0);
  due_.clear();
  early_.assign(m, 0);
  for (const auto& [u, v] : due) {
    ++due_start_[static_cast<size_t>(u) + 1];
    due_.push_back(v);
    early_[static_cast<size_t>(v)] = 1;
  }
  for (size_t k = 0; k < n; ++k) due_start_[k + 1] += due_start_[k];
}

std::pair<const int32_t*, const int32_t*> StepPlan::due_after(size_t k) const {
  if (k >= step_.op.size()) return {nullptr, nullptr};
  return {due_.data() + due_start_[k], due_.data() + due_start_[k + 1]};
}

bool StepPlan::matches(const StepArrays& s, size_t k) const {
  const StepArrays& p = step_;
  if (k >= p.op.size() || s.op[k] != p.op[k]) return false;
  const auto span = [](const std::vector<int64_t>& start, size_t k) { return std::make_pair(start[k], start[k + 1]); };
  const auto [a0, a1] = span(s.inputs_start, k);
  const auto [b0, b1] = span(p.inputs_start, k);
  if (a1 - a0 != b1 - b0 || !std::equal(s.inputs.begin() + a0, s.inputs.begin() + a1, p.inputs.begin() + b0))
    return false;
  const auto [c0, c1] = span(s.outputs_start, k);
  const auto [d0, d1] = span(p.outputs_start, k);
  if (c1 - c0 != d1 - d0) return false;
  const auto bytes = [](const StepArrays& x, int64_t i) {
    return x.value_bytes[static_cast<size_t>(x.outputs[static_cast<size_t>(i)])];
  };
  for (int64_t i = 0; i < c1 - c0; ++i)
    if (bytes(s, c0 + i) != bytes(p, d0 + i)) return false;
  return true;
}

int64_t StepPlan::next_use_at(int32_t v, size_t k) const {
  const size_t n = step_.op.size();
  if (v < 0 || static_cast<size_t>(v) >= step_.value_bytes.size()) return -1;
  const auto first = uses_.begin() + use_start_[static_cast<size_t>(v)];
  const auto last = uses_.begin() + use_start_[static_cast<size_t>(v) + 1];
  const auto next = std::lower_bound(first, last, static_cast<int32_t>(std::min(k, n)));
  return next == last ? static_cast<int64_t>(n) : *next;
}

double StepPlan::seconds_to_next_use(int32_t v, size_t k) const {
  const int64_t q = next_use_at(v, k);
  if (q < 0) return -1.0;
  if (static_cast<size_t>(q) == step_.op.size()) return std::numeric_limits<double>::infinity();
  return before_[static_cast<size_t>(q)] - before_[std::min(k, step_.op.size())];
}

}  // namespace pymem
