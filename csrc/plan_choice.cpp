// plan_choice.cpp — the way each step is planned, by measure (see plan_choice.h).
#include "plan_choice.h"

#include <algorithm>

namespace pymem {

void PlanChoice::reset() {
  for (int w = 0; w < kWays; ++w) {
    measured_steps_[w] = 0;
    num_moves_[w] = 0;
    sit_out_[w] = 0;
    next_sit_out_[w] = 1;
  }
  streak_ = 0;
  probe_every_ = kProbeEvery;
  last_best_ = -1;
  probe_ = 0;
  probing_ = -1;
  probe_left_ = 0;
  asked_ = false;
  last_ran_ = -1;
}

int PlanChoice::cheapest(int except) const {
  int best = -1;
  for (int w = 0; w < kWays; ++w)
    if (w != except && (best < 0 || latest_cost_[w] < latest_cost_[best])) best = w;
  const double near = latest_cost_[best] * kCoverTolerance;  // a cover within it wins (the cheaper one)
  int cover = -1;
  for (const Releases r : {Releases::kCover, Releases::kRebuild}) {
    const int c = at(r);
    if (c != except && latest_cost_[c] <= near && (cover < 0 || latest_cost_[c] < latest_cost_[cover])) cover = c;
  }
  return cover >= 0 ? cover : best;
}

void PlanChoice::measured(Releases ran, double comeback, double moves) {
  const int w = at(ran);
  const bool steady = w == last_ran_;  // the step before ran the same way: no switch in this measure
  last_ran_ = w;
  asked_ = false;
  double cost = comeback + moves;
  if (steady) {  // its moves: the mean of its last steady steps'
    moves_[w][num_moves_[w]++ % kMovesWindow] = moves;
    const int64_t k = std::min<int64_t>(num_moves_[w], kMovesWindow);
    double sum = 0;
    for (int64_t i = 0; i < k; ++i) sum += moves_[w][i];
    cost = comeback + sum / static_cast<double>(k);
  }
  if (measured_steps_[w] < kTrialsEach || steady) latest_cost_[w] = cost;
  ++measured_steps_[w];
  if (probing_ != w || --probe_left_ > 0) return;  // a probe's first step: its second measures the way
  probing_ = -1;
  // A probe that loses waits twice as long for the next turn (one that takes over is a new
  // cheapest: next() brings the turns back to every kProbeEvery steps).
  if (cheapest() != w) probe_every_ = std::min(2 * probe_every_, kMaxProbeEvery);
  if (cost > kFar * latest_cost_[cheapest(w)]) {  // far behind still: probed less often
    sit_out_[w] = next_sit_out_[w];
    next_sit_out_[w] = std::min(2 * next_sit_out_[w], kMaxSitOut);
  } else {
    sit_out_[w] = 0;
    next_sit_out_[w] = 1;
  }
}

PlanChoice::Releases PlanChoice::next(bool cover_allowed) {
  if (asked_) {  // the step asked for last was not measured (it left its plan): nothing follows on from it
    last_ran_ = -1;
    probing_ = -1;
  }
  asked_ = true;
  if (probing_ >= 0 && cover_allowed) return static_cast<Releases>(probing_);  // a probe's second step
  probing_ = -1;
  if (!cover_allowed) return Releases::kLearned;
  for (int w = 0; w < kWays; ++w)  // the trials, in the order of Releases
    if (measured_steps_[w] < kTrialsEach) return static_cast<Releases>(w);
  const int best = cheapest();
  if (best != last_best_) {  // a new cheapest: its first probe turn kProbeEvery steps on
    probe_every_ = kProbeEvery;
    streak_ = 0;
    last_best_ = best;
  }
  if (streak_ < probe_every_) {
    ++streak_;
    return static_cast<Releases>(best);
  }
  streak_ = 0;
  for (int turn = 0; turn < kWays; ++turn) {  // the other ways in turn, past those sitting out
    const int w = probe_;
    probe_ = (probe_ + 1) % kWays;
    if (w == best) continue;
    if (sit_out_[w] > 0) {
      --sit_out_[w];
      continue;
    }
    probing_ = w;
    probe_left_ = kTrialsEach;
    return static_cast<Releases>(w);
  }
  return static_cast<Releases>(best);  // every other way sits this turn out
}

}  // namespace pymem
