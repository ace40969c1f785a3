// plan_choice.h — how to plan the next step: learn from the greedy's releases, or cover the
// step's overflow (step_plan.h), chosen from what the steps that followed each way cost. The step
// trace asks it at every step's end; the simulator (pymem/sim/plan.py) asks the same object, so a
// replay plans as the runtime would.
//
// Each way is measured on the steps that follow it whole since the program last changed, by the
// memory work it costs: bringing values back (comeback_cost) and moving blocks in compactions (a
// plan that releases out of order leaves holes that compaction pays for). Each is first tried for kTrialSteps steps, learned
// then cover; then the next step takes the cheaper by its latest measure (the learned plan keeps
// learning, from its own steps, so its early steps overstate it), the cover on a tie within
// kCoverTolerance (it frees memory in order: less compaction), and after every kProbeEvery steps
// of one way, one step of the other measures it again.
#pragma once

#include "step_plan.h"

#include <cstdint>

namespace pymem {

class PlanChoice {
 public:
  using Releases = StepPlan::Releases;
  static constexpr double kCoverTolerance = 1.05;
  static constexpr int64_t kTrialSteps = 2;
  static constexpr int64_t kProbeEvery = 5;

  // Nothing measured holds any more: a new program, a step that left its plan, another budget.
  void reset();
  // A step that followed a plan made `ran`'s way, whole, cost `cost` seconds of memory work.
  void measured(Releases ran, double cost);
  // The way to plan the next step; the cover only where `cover_allowed` (a budget to cover).
  Releases next(bool cover_allowed);

 private:
  static int at(Releases r) { return static_cast<int>(r); }
  double latest_cost_[2] = {0, 0};  // per Releases
  int64_t measured_steps_[2] = {0, 0};
  int64_t streak_ = 0;  // steps the cheaper way ran since the last probe
};

}  // namespace pymem
