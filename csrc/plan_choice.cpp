// plan_choice.cpp — the way each step is planned, by measure (see plan_choice.h).
#include "plan_choice.h"

namespace pymem {

void PlanChoice::reset() {
  for (int64_t& n : measured_steps_) n = 0;
  streak_ = 0;
  probe_ = 0;
}

void PlanChoice::measured(Releases ran, double cost) {
  latest_cost_[at(ran)] = cost;
  ++measured_steps_[at(ran)];
}

PlanChoice::Releases PlanChoice::next(bool cover_allowed) {
  if (!cover_allowed) return Releases::kLearned;
  for (int w = 0; w < kWays; ++w)  // the trials, in the order of Releases
    if (measured_steps_[w] < kTrialsEach) return static_cast<Releases>(w);
  int cheapest = 0;
  for (int w = 1; w < kWays; ++w)
    if (latest_cost_[w] < latest_cost_[cheapest]) cheapest = w;
  if (latest_cost_[at(Releases::kCover)] <= latest_cost_[cheapest] * kCoverTolerance) cheapest = at(Releases::kCover);
  if (streak_ < kProbeEvery) {
    ++streak_;
    return static_cast<Releases>(cheapest);
  }
  streak_ = 0;
  if (probe_ == cheapest) probe_ = (probe_ + 1) % kWays;
  const int probe = probe_;
  probe_ = (probe_ + 1) % kWays;
  return static_cast<Releases>(probe);
}

}  // namespace pymem
