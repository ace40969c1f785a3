// plan_choice.cpp — learned or cover, by measure (see plan_choice.h).
#include "plan_choice.h"

namespace pymem {

void PlanChoice::reset() {
  measured_steps_[0] = measured_steps_[1] = 0;
  streak_ = 0;
}

void PlanChoice::measured(Releases ran, double cost) {
  latest_cost_[at(ran)] = cost;
  ++measured_steps_[at(ran)];
}

PlanChoice::Releases PlanChoice::next(bool cover_allowed) {
  if (!cover_allowed || measured_steps_[at(Releases::kLearned)] < kTrialSteps) return Releases::kLearned;
  if (measured_steps_[at(Releases::kCover)] < kTrialSteps) return Releases::kCover;
  const Releases cheaper = latest_cost_[at(Releases::kCover)] <= latest_cost_[at(Releases::kLearned)] * kCoverTolerance
                               ? Releases::kCover
                               : Releases::kLearned;
  const Releases other = cheaper == Releases::kCover ? Releases::kLearned : Releases::kCover;
  const Releases how = streak_ >= kProbeEvery ? other : cheaper;
  streak_ = how == cheaper ? streak_ + 1 : 0;
  return how;
}

}  // namespace pymem
