// step_plan.h — the future of a training step, read from the step before it (issue 13's guided
// release): when each value is next used, and how much work runs until then.
//
// A training step repeats: the same ops, in the same order, on values numbered the same way (see
// step_trace.h). So the last complete step, read backwards, says for the step now running what
// Belady's rule needs: for a value v at op position k, the position of its next use, and the
// planned seconds of work between (the costs the last step booked). The plan holds only while the
// step follows it: StepTrace checks every op booked against the plan's op at that position (its
// code, its inputs' value numbers, its fresh outputs' bytes) and stops consulting the plan at the
// first mismatch (a divergence: data-dependent control flow, another shape), until the next step,
// which is then planned from the diverging step.
//
// Layout (arrays, built once per step from StepArrays):
//   use_start[v] .. use_start[v+1]   indices into `uses`: the positions of the ops reading v, ascending
//   before[k]                        planned seconds of the ops before position k (before[0] = 0)
//   due_start[k] .. due_start[k+1]   indices into `due`: values to release right after op k
//
// Early release, two of the ways (`Releases`), both right after a value's last use before a gap in
// its uses, where its memory would otherwise sit unused until pressure came, so memory is freed in the
// order the step stops needing it and the pressure handler (and compaction) has less to do:
//   kLearned: a value the step before released (under pressure, or early itself) at position p, and
//     reads again only a long stretch later (kLongStretch of the step), is released after its last
//     use before p. Nothing reads it between the two positions (the plan says so while the step
//     follows it), so releasing earlier recomputes nothing more. It learns from the runtime's
//     greedy choices, and keeps them.
//   kCover, kRebuild: the values plan_cover.h picks from the step's live bytes and the budget, the
//     cheapest cover of where the step overflows, whatever the greedy choices were: kCover prices
//     each comeback with the lineage it reruns, kRebuild plans what those reruns rebuild (kept
//     where it fits, released again right after where not).
// A value the plan releases early may have evicted readers: kLearned leaves those to pressure
// (it does not price the longer recompute), the covers priced them and release them anyway.
// Two ways release nothing early: kBelady (pressure alone releases, scored by the plan's next
// uses) and kGreedy (the policy alone, as without a plan: StepTrace hides the next uses; the step is
// still checked against the plan, so that it is measured as the others are). plan_choice.h chooses.
//
// Invariants: built and read under the runtime's lock; a plan is immutable once built.
#pragma once

#include "step_arrays.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace pymem {

class StepPlan {
 public:
  enum class Releases { kLearned, kCover, kRebuild, kBelady, kGreedy };  // the ways, in the order they are tried
  static bool covers(Releases how) { return how == Releases::kCover || how == Releases::kRebuild; }
  // The plan for a step like `s` (empty when s has no ops). kLearned learns from `learned_from`'s
  // releases and comebacks (a step like s: s itself, or the last step that ran a kLearned plan);
  // the covers release `cover` (cover_releases or rebuild_releases of a step like s).
  void build(const StepArrays& s, Releases how, const StepArrays& learned_from,
             const std::vector<std::pair<int32_t, int32_t>>& cover);
  Releases releases() const { return how_; }
  bool empty() const { return step_.op.empty(); }
  size_t size() const { return step_.op.size(); }  // ops in the planned step

  // Whether the op booked at position k of the step being recorded (its code, input values and
  // fresh outputs' bytes: `s` holds them, just appended) is the op the plan has there.
  bool matches(const StepArrays& s, size_t k) const;

  // Planned seconds from position k (the op running now, or the next to run) until the next op at
  // or after k that reads value v; +infinity when none does for the rest of the step; -1 when v is
  // not one of the plan's values.
  double seconds_to_next_use(int32_t v, size_t k) const;
  // The position of that op (the step's length when none; -1 when v is not one of the plan's values).
  int64_t next_use_at(int32_t v, size_t k) const;
  // Planned seconds of the ops before position k (k past the step's end: the whole step).
  double seconds_before(size_t k) const { return before_.empty() ? 0.0 : before_[std::min(k, before_.size() - 1)]; }

  // Values to release right after op k; whether value v is one at some position.
  std::pair<const int32_t*, const int32_t*> due_after(size_t k) const;
  // A value is released early only when its next use is at least this share of the step away.
  static constexpr double kLongStretch = 0.25;

  bool released_early(int32_t v) const {
    return v >= 0 && static_cast<size_t>(v) < early_.size() && early_[static_cast<size_t>(v)];
  }

 private:
  void index(const StepArrays& s);  // step_, uses, before
  std::vector<std::pair<int32_t, int32_t>> learned(const StepArrays& from) const;
  void set_releases(std::vector<std::pair<int32_t, int32_t>> due);  // (position, value) pairs

  Releases how_ = Releases::kLearned;
  StepArrays step_;  // the step planned from (a copy)
  std::vector<int64_t> use_start_;
  std::vector<int32_t> uses_;
  std::vector<double> before_;
  std::vector<int64_t> due_start_;
  std::vector<int32_t> due_;
  std::vector<uint8_t> early_;
};

}  // namespace pymem
