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
// no offset. Where some get none, the same first fit is tried in three more orders (longest lived
// first, most bytes x clock first, allocation order: which order packs a full region turns on the
// lifetimes), then all four putting each block into the smallest gap that holds it (TFLite's
// greedy by size), each order passed over again with the blocks it left out first (a squeaky
// wheel; bounded, end_step), and the first that gives every block an offset is the plan. In the
// next step, allocation k takes its planned offset when that range is free. When it is not, a block of this
// step outlived its counterpart of the step before (the step before's pressure released it there,
// or compaction moved it): allocation k is displaced. It then goes to
// the lowest free range that no planned block whose lifetime meets k's covers (the plan's room for
// it elsewhere), or where there is none, by best fit; the step goes on with its plan. Why not best
// fit for the rest of the step, as before: a displacement recurs every step (each step's pressure
// releases are what the next step's plan is made around), and best fit from there on fragments the
// rest of the step; with the plan's room, the transformer of bench/plan_ways.py at 0.3 of its peak,
// the cover followed every step, moved 6 MiB a step instead of 32, deep there 8 instead of 14
// (leaving the plan where no room is found moved 48-53 on the transformer). That holds where
// steps repeat: the runtime keeps a plan through displacements in a step planned the same way as
// the step it comes from (plan_choice.h), leaves it at the first displacement in other steps, and
// carries none into a step planned another way than the planned step before it, which is placed by
// best fit throughout (the first planned step takes the unplanned step's plan): carried over, a
// switch of ways displaced blocks all over the step, and the layout a way settled into depended
// on the way before it (the simulator's TinyGPT at 0.6 of its peak: 0.1835 ms recomputed after
// greedy's layout, 0.1730 after its own). Only a request of no size the plan has next leaves the
// plan (and a displacement, in a plan taken over by set_plan, which knows no lifetimes, or where
// the runtime says so): it and the rest of the step are placed by best fit, as with no plan.
// Nothing here decides what is released, and an offset is only taken where it is
// free: the plan changes addresses, never contents.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
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
  // A displacement leaves the plan (best fit for the rest of the step) unless keeps_plan().
  void count_placed(bool placed) {
    (placed ? num_placed_ : num_displaced_)++;
    if (!placed && !keeps_plan()) diverged_ = true;
  }
  // Whether a displaced allocation goes to the plan's room and the step keeps its plan: as the
  // runtime sets it per step (Arena::set_step_placement_keeps_plan), and never in a plan taken
  // over by set_plan, which knows no lifetimes (the simulator's replays, as before).
  bool keeps_plan() const { return keep_plan_ && !spans_.empty(); }
  void set_keeps_plan(bool on) { keep_plan_ = on; }
  // For the allocation planned_offset just matched, displaced: the main-region offset ranges
  // [lo, hi) (ascending) that no planned block whose lifetime meets its own covers, nor a block
  // the step before ended with while it lasts. Empty where the plan knows no lifetimes (set_plan).
  std::vector<std::pair<size_t, size_t>> room_for_displaced(size_t region_size) const;

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
  // The plan's blocks over the step's clock (the step before's), in offset order, for
  // room_for_displaced: each planned allocation (index), and the blocks the step before ended
  // with (index -1).
  struct Span {
    size_t offset, size;
    int64_t from, to;  // [from, to) of the clock
    int64_t index;
    bool meets(int64_t f, int64_t t) const { return from < t && f < to; }
  };
  std::vector<Span> spans_;
  std::vector<int64_t> span_of_;  // by allocation index: its span in spans_ (-1: none)
  bool diverged_ = false;  // the step left its plan: best fit for the rest of it
  bool keep_plan_ = true;
  size_t next_ = 0;  // the plan's first allocation not yet matched in this step
  size_t matched_ = SIZE_MAX;  // what planned_offset matched, taken by allocated() (a retry after pressure asks again)
  static constexpr size_t kLookahead = 16;
  // Planning is quadratic in the step's large allocations (each scans the blocks placed so far):
  // 8192 of them take ~50 ms, a fraction of a step that long (at ~20 us of bookkeeping per op).
  // A longer step gets no plan: best fit throughout.
  static constexpr size_t kMaxPlanned = 8192;
  // Where no order packs a step whole at once, each is passed over again with what it left out
  // first (end_step), up to kMaxExtraPasses more times, while those passes stay under
  // kRetryVisits span visits. A step no pass packs pays for them all, every step: at 263 blocks
  // 32 passes, ~4 ms (one took ~0.12 ms); the transformer of bench/plan_ways.py at 0.3 packs on
  // its second.
  static constexpr size_t kMaxExtraPasses = 3;
  static constexpr size_t kRetryVisits = size_t(1) << 22;
  Step now_, before_;
  std::vector<int64_t> before_freed_at_;  // per index of the step before: when this step freed it (-1: not yet)
  uint32_t next_serial_ = 0;
  int64_t clock_ = 0;
  int64_t num_placed_ = 0, num_displaced_ = 0;
};

}  // namespace pymem
