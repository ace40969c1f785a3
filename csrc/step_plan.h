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
// Retention, with kRebuild (which plans what reruns rebuild): a value of at most `retain_limit`
// bytes that the program freed after op f and that a rerun rebuilt later in the step before (a
// comeback after its death: a recompute read it, as attention's backward reruns the softmax from
// the causal mask) is held from right after f until right after its last such comeback, so the
// rerun reads it instead of replaying its chain. A held value stays releasable (pressure may take
// it, as any other). One held in the step before stays held while pressure left it alone there
// (held, it came back no more, so that step alone no longer shows why). A value some op overwrote
// in place is never held: its storage is the new value's. The other ways hold nothing, so the
// choice among them (plan_choice.h) measures holding too: it costs memory that pressure must then
// find elsewhere (see kRetainShare).
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
  struct Hold {  // a value held past the program's free of it: from right after op `from` until right after op `until`
    int32_t value, from, until;
  };
  static bool covers(Releases how) { return how == Releases::kCover || how == Releases::kRebuild; }
  // The plan for a step like `s` (empty when s has no ops). kLearned learns from `learned_from`'s
  // releases and comebacks (a step like s: s itself, or the last step that ran a kLearned plan);
  // the covers release `cover` (cover_releases or rebuild_releases of a step like s).
  // `holds`: retained(s, retain_limit, the holds of the plan s ran, if s followed it whole); kept by kRebuild.
  void build(const StepArrays& s, Releases how, const StepArrays& learned_from,
             const std::vector<std::pair<int32_t, int32_t>>& cover, std::vector<Hold> holds = {});
  // The values a plan for a step like `s` holds past their free (see Retention above): `s` with its
  // deaths and events, `before` the holds s ran with. Empty where s has no deaths observed.
  static std::vector<Hold> retained(const StepArrays& s, int64_t retain_limit, const std::vector<Hold>& before);
  // A value held is at most this share of the budget: small beside what the covers plan for (they
  // take the program's deaths as they are). Holding up to 1/256 (GPT-2 XL's 50 MB activations from
  // the forward pass to backward, in the simulator at 0.5) made `rebuild` measure worse than the cover.
  static constexpr int64_t kRetainShare = 1024;
  const std::vector<Hold>& holds() const { return holds_; }
  // The values to hold right after op k, and those to let go then.
  std::pair<const int32_t*, const int32_t*> holds_after(size_t k) const { return span(hold_start_, hold_, k); }
  std::pair<const int32_t*, const int32_t*> let_go_after(size_t k) const { return span(let_go_start_, let_go_, k); }
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
  void set_holds(std::vector<Hold> holds);
  // By position (start[k] .. start[k+1] into `values`); empty past the step's end.
  static std::pair<const int32_t*, const int32_t*> span(const std::vector<int64_t>& start,
                                                        const std::vector<int32_t>& values, size_t k) {
    if (k + 1 >= start.size()) return {nullptr, nullptr};
    return {values.data() + start[k], values.data() + start[k + 1]};
  }

  Releases how_ = Releases::kLearned;
  StepArrays step_;  // the step planned from (a copy)
  std::vector<int64_t> use_start_;
  std::vector<int32_t> uses_;
  std::vector<double> before_;
  std::vector<int64_t> due_start_;
  std::vector<int32_t> due_;
  std::vector<uint8_t> early_;
  std::vector<Hold> holds_;
  std::vector<int64_t> hold_start_, let_go_start_;
  std::vector<int32_t> hold_, let_go_;
};

}  // namespace pymem
