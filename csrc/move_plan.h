// move_plan.h — planning a compaction (pymem/compaction_plan.py's plan, bytes_to_move and
// cheapest_window, in C++): by moves alone, or with releases in the segment cleared.
//
// Why here: under pressure the handler first asks whether sliding the free bytes together costs
// less than releasing (pressure.py, _moves_cheaper), and the simulator asks the same. Most of those
// questions end in "release", and planned in Python each cost a walk over every block of the arena
// and a tuple per block: on Hugging Face GPT-2 at a third of its peak that was about a third of the
// pressure handler's host time, the time a GPU waits for. The runtime and the simulator both call
// this one plan, and the general one (plan_compaction, below); compaction_plan.py is the reference
// tests/test_compaction_plan.py holds both to.
//
// The plan. The main region is cut into segments by the allocated blocks that may not move (a
// block counts as free when `freed` holds its address). For each segment, its movable blocks
// are moved, largest first (of equal sizes, the lower address first), each into the smallest
// free block of another segment that holds it (of equal sizes the first in address order), until
// the segment's free bytes plus those moved out cover the request; a segment where they do not is
// not a candidate. Each candidate's window: of the runs of the segment that end with a free block
// and hold the request free (moved-out blocks counted free), the one with the fewest allocated
// bytes to slide; the whole segment where none does. Of the candidates the one that moves the
// fewest bytes wins (moved out plus slid; the first of equal ones): a segment's movable bytes,
// the measure before, counted blocks its window leaves in place.
//
// Invariants: pure (reads the block list it is given); deterministic; `blocks` in address order,
// main region first, as Arena::blocks() returns them.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

#include "types.h"

namespace pymem {

struct MovePlan {
  std::vector<uintptr_t> segment_movable;              // the chosen segment's movable blocks, address order
  std::vector<std::pair<uintptr_t, uintptr_t>> moves;  // (from, to), in the order to carry them out
  std::vector<uintptr_t> window;                       // the blocks to slide once the moves are done
  uint64_t bytes_to_move = 0;                          // moved out plus slid
};

// The plan for `request` bytes, or nothing where moves alone cannot make it fit. `movable`: the
// addresses of allocated main-region blocks that may move; `freed`: addresses of allocated blocks
// to count as free (a picture after releasing them).
std::optional<MovePlan> plan_moves(const std::vector<Block>& blocks, const std::unordered_set<uintptr_t>& movable,
                                   const std::unordered_set<uintptr_t>& freed, uint64_t request);

// The general plan (compaction_plan.py's plan): as plan_moves, but where a segment's free bytes
// plus its moves out fall short of the request, the blocks of `order` in it (addresses of
// releasable blocks, lowest score first; not those moved out) are released in that order until
// they cover the rest; a segment they cannot cover is no candidate. Of the candidates the cheapest
// release wins, then the fewest bytes moved (the first of equal ones). `cost_of(i)`: what releasing
// order[i] costs, asked only for the releases a candidate takes (the caller's policy prices them).
// Why in C++: the general plan in Python walked a Python picture of every block of the arena
// (Arena.blocks(), then a tuple per block): on Hugging Face GPT-2 small at a third of its peak,
// about 1.8 ms a call and 37 ms of the pressure handler's host time a step.
struct CompactionPlan {
  MovePlan moves;
  std::vector<size_t> released;  // indices into `order`, in release order
  double release_cost = 0.0;
};
std::optional<CompactionPlan> plan_compaction(const std::vector<Block>& blocks,
                                              const std::unordered_set<uintptr_t>& movable,
                                              const std::unordered_set<uintptr_t>& freed,
                                              const std::vector<uintptr_t>& order, uint64_t request,
                                              const std::function<double(size_t)>& cost_of);

// The other side of the question: releasing values in `order` (their blocks' addresses, lowest
// score first) one at a time until `request` fits in one free block of the main region
// (compaction_plan.py's release_path_seconds, less the pricing). `taken`: the indices into `order`
// released (an address that is not an allocated main-region block, or one released already, is
// skipped). Returns kFits when the last one made a free run that holds the request, kReached when
// the released bytes covered the request first (a compaction must follow), kNever when `order`
// ran out.
enum class ReleasePath : uint8_t { kFits = 0, kReached = 1, kNever = 2 };
ReleasePath release_path(const std::vector<Block>& blocks, const std::vector<uintptr_t>& order, uint64_t request,
                         std::vector<size_t>& taken);

}  // namespace pymem
