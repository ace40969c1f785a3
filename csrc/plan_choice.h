// plan_choice.h — how to plan the next step (step_plan.h's ways): learn early releases from the
// greedy's, cover the step's overflow (two ways: plan_cover.h), only read next uses (Belady's
// scores, no early release), or run the policy alone (greedy, as the unplanned first step),
// chosen from what the steps that followed each way cost. The step trace asks it at every step's
// end; the simulator (pymem/sim/plan.py) asks the same object, so a replay plans as the runtime
// would.
//
// Why five ways: none wins everywhere. Recompute seconds per step with fixed op costs
// (bench/plan_ways.py): at the CNN's checkpointed peak greedy 0.166, learned 0.10, the cover 0.077,
// next uses alone 0.058; on the 4-layer TinyGPT at 0.3 of its peak greedy 0.109-0.118, next uses
// alone 0.130, the plans with early releases 0.13-0.16 (Belady's choices bring whole chains back at
// a tight budget, where DTR's staleness keeps their ancestors). So `auto` measures each, and is
// never worse than the greedy policy for long.
//
// Each way is measured on the steps that follow it whole since the program last changed, by the
// memory work it costs: bringing values back (comeback_cost) and moving blocks in compactions (a
// plan that releases out of order leaves holes that compaction pays for). Each is first tried for
// kTrialsEach steps, in turn (a step starts from what the step before left in memory, so the second
// of two steps run the same way measures that way; the learned plan also keeps learning from its
// own steps); then the next step takes the cheapest by its latest measure, the cheaper cover on a
// tie within kCoverTolerance (a cover frees memory in order: less compaction), and after every
// kProbeEvery steps of one way, kTrialsEach steps of another (each in turn) measure it again.
// Each probe that loses doubles the steps before the next turn, up to kMaxProbeEvery; a new
// cheapest (a probe that takes over, or the cheapest's own measure rising past another's) starts
// again from kProbeEvery. A probe, and the step back after it, move what the other way left: at 0.3
// of the transformer's peak at fixed rates (bench/plan_ways.py, 48 steps) the settled way's steps
// moved 0-22 MiB of a 55.5 MiB budget, its probes 6-107 and the steps back 16-67, which made the
// mean 0.43x of the budget with a turn every five steps; backed off, 0.15x over 96 steps (deep
// 0.36x -> 0.13x), recomputing 2% less. The cost: a way that became cheaper is probed again
// only at its turn, four turns of up to 64 steps apart (more where it sits turns out).
// A way's measure is its latest comebacks plus the mean of its moves over its last kMovesWindow
// steady steps: which blocks compaction moves turns on where pressure found them, and one step's
// moves swing where its comebacks do not (rebuild at the transformer's checkpointed peak, fixed
// costs, its covers pruned with no slack (plan_cover.h): 22, 110, 69 and 22 MiB in four steps of
// 0.053 s of comebacks each, and by its latest measure the choice left it for learned, 0.064 s,
// after the 110).
// Past the trials, only a step that follows one run the same way updates its way's measure: the
// first after a switch pays for the layout the other way left (the step placement's plan is
// another way's, step_placement.h), which the way's own steps do not (GPT-2 XL in the simulator
// at 0.7: rebuild after rebuild 1.062x with no moves, after greedy 1.152x). A probe
// costs what its way costs more than the cheapest (a greedy step at the CNN's checkpointed peak:
// 3x), so a way whose probe measured over kFar times the cheapest sits out its next turns, twice
// as many each time it does so again (up to kMaxSitOut turns); a probe that measures near the
// cheapest brings it back to every turn. Where nothing may be covered (no budget, or values are
// offloaded: copies out ahead and back follow the learned plan's releases), every step is learned.
#pragma once

#include "step_plan.h"

#include <cstdint>

namespace pymem {

class PlanChoice {
 public:
  using Releases = StepPlan::Releases;
  static constexpr int kWays = 5;  // Releases' values
  static constexpr double kCoverTolerance = 1.05;
  static constexpr int64_t kTrialsEach = 2;  // the second, measured from a step run the same way
  static constexpr int64_t kTrialSteps = kTrialsEach * kWays;  // steps before the first choice
  static constexpr int64_t kProbeEvery = 5;      // steps of the cheapest before the first probe turn
  static constexpr int64_t kMaxProbeEvery = 64;  // ... and, doubled by each probe that loses, the most
  static constexpr double kFar = 1.5;
  static constexpr int64_t kMaxSitOut = 8;

  PlanChoice() { reset(); }
  // Nothing measured holds any more: a new program, a step that left its plan, another budget.
  void reset();
  // A step that followed a plan made `ran`'s way, whole, cost `comeback` seconds of memory work
  // bringing values back and `moves` moving blocks.
  void measured(Releases ran, double comeback, double moves = 0.0);
  // The way to plan the next step; only kLearned unless `cover_allowed` (a budget to cover, no offloading).
  Releases next(bool cover_allowed);

 private:
  static int at(Releases r) { return static_cast<int>(r); }
  int cheapest(int except = -1) const;  // by latest measure, a cover on a tie (the others: `except` left out)
  static constexpr int kMovesWindow = 3;
  double latest_cost_[kWays] = {};  // per Releases: comebacks + moves, as above
  double moves_[kWays][kMovesWindow] = {};  // the moves of a way's last steady steps (a ring)
  int64_t num_moves_[kWays] = {};
  int64_t measured_steps_[kWays] = {};
  int64_t streak_ = 0;  // steps the cheapest way ran since the last probe
  int64_t probe_every_ = kProbeEvery;  // steps of the cheapest before the next probe turn
  int last_best_ = -1;  // the cheapest when next() last chose it (a change starts probing often again)
  int probe_ = 0;       // the way the next probe turn starts from, in turn over the others
  int probing_ = -1;    // the way being probed (-1: none)
  int64_t probe_left_ = 0;  // its steps still to be measured
  bool asked_ = false;      // next() gave a step that measured() has not seen yet
  int last_ran_ = -1;       // the way of the step measured last
  int64_t sit_out_[kWays] = {};       // probe turns a way still sits out
  int64_t next_sit_out_[kWays] = {};  // turns it sits out if its next probe is far again (reset() sets 1)
};

}  // namespace pymem
