// step_placement.h — where each large block of a repeating training step goes, planned from the
// step before (a static memory planner's offsets, learned at run time).
//
// Why: under a tight budget, best fit leaves the freed bytes of a step in holes, and compaction
// then moves blocks to join them (on the CPU models at 0.3 of their peak, 0.7-1.3x the budget per
// step). A training step repeats: the step before told us every block's size and lifetime, so the
// next step can put each block where it never blocks a later one — the offsets a compiler's memory
// planner assigns (TFLite's and XLA's greedy by size), here from a recorded step, not a graph.
//
// How: while recording, every main-region allocation of a step gets an index (its order in the
// step) and its block a serial (Block::serial); an event clock ticks on each allocation and free.
// At the step's end, each block allocated in the step is an interval [allocated, freed) of that
// clock (the step's end for one that outlives it); the blocks still allocated are obstacles at
// their addresses, until the clock time the step before's counterpart was freed (a gradient freed
// by zero_grad early in the next step), or for ever. Blocks are placed largest first, each at the
// lowest offset no time-overlapping placed block covers; one that would pass the region's end gets
// no offset. In the next step, allocation k takes its planned offset when that range is free. When
// it is not (the step released or brought back other values than the one before), or a request is
// of no size the plan has next, the step has left its plan: it and the rest of the step are placed
// by best fit, as with no plan. Why not keep following the plan past that: a plan only holds
// together whole; in the runtime's steps (bench/plan_ways.py), taking the planned offsets that were
// still free after a displacement moved more bytes per step than best fit on most models. Nothing
// here decides what is released, and an offset is only taken where it is free: the plan changes
// addresses, never contents.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pymem {

// The serial of a main-region block allocated while nothing records (Block::serial).
constexpr uint32_t kNoSerial = UINT32_MAX;

class StepPlacement {
 public:
  // A block allocated when a step ends: its offset in the main region, size, serial.
  struct Live {
    size_t offset, size;
    uint32_t serial;
  };

  // The offset planned for the step's next main-region allocation of `rounded` bytes (the plan's
  // first of that size among its next kLookahead); -1 for none. Asked again after pressure, it
  // answers the same: the match is taken by the allocation that follows.
  int64_t planned_offset(size_t rounded);
  // A main-region allocation of the plan's size class happened (at the planned offset or not):
  // takes the match, returns the block's serial.
  uint32_t allocated(size_t rounded);
  // A main-region block of `serial` was freed.
  void freed(uint32_t serial);
  // The step ended with `live` allocated in a main region of `region_size` bytes: plan the next.
  void end_step(const std::vector<Live>& live, size_t region_size);

  // The plan for the next step: an offset (-1: none) and a size per allocation index. A fresh
  // arena replaying the same step takes it over (the simulator's replays, one arena each).
  const std::vector<int64_t>& plan_offsets() const { return plan_; }
  const std::vector<size_t>& plan_sizes() const { return plan_size_; }
  // Replaces the plan for the step now starting (validated by the caller: equal lengths, offsets
  // -1 or inside the region).
  void set_plan(std::vector<int64_t> offsets, std::vector<size_t> sizes);
  int64_t num_placed() const { return num_placed_; }    // blocks that got their planned offset
  int64_t num_displaced() const { return num_displaced_; }  // planned ones whose range was taken
  void count_placed(bool placed) {
    (placed ? num_placed_ : num_displaced_)++;
    if (!placed) diverged_ = true;
  }

 private:
  static constexpr int64_t kNever = INT64_MAX;
  struct Step {  // the allocations of one step, by index
    std::vector<size_t> size;
    std::vector<int64_t> allocated_at, freed_at;  // clock times; freed_at -1: outlived the step
    uint32_t first_serial = 0;
    bool holds(uint32_t serial) const { return uint32_t(serial - first_serial) < size.size(); }
  };
  std::vector<int64_t> plan_;  // offset per allocation index of this step (-1: best fit)
  std::vector<size_t> plan_size_;
  bool diverged_ = false;  // the step left its plan: best fit for the rest of it
  size_t next_ = 0;  // the plan's first allocation not yet matched in this step
  size_t matched_ = SIZE_MAX;  // what planned_offset matched, taken by allocated() (a retry after pressure asks again)
  static constexpr size_t kLookahead = 16;
  // Planning is quadratic in the step's large allocations (each scans the blocks placed so far):
  // 8192 of them take ~50 ms, a fraction of a step that long (at ~20 us of bookkeeping per op).
  // A longer step gets no plan: best fit throughout.
  static constexpr size_t kMaxPlanned = 8192;
  Step now_, before_;
  std::vector<int64_t> before_freed_at_;  // per index of the step before: when this step freed it (-1: not yet)
  uint32_t next_serial_ = 0;
  int64_t clock_ = 0;
  int64_t num_placed_ = 0, num_displaced_ = 0;
};

}  // namespace pymem
