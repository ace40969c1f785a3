// plan_cover.h — which values a step releases, chosen from the whole step at once (Capuchin's
// guided mode: measure the step, find where it overflows the budget, pick what to recompute there).
//
// The live bytes of a step that releases nothing are known from its trace: a value occupies its
// bytes from its producer to its last use (values made before the step: the whole step). Where
// that profile is above the budget, some values must be away. A candidate is one value away
// across one gap between two of its uses (or its producer and first use): released right after
// the earlier op, recomputed for the later one. It frees its bytes over the gap, where they count
// only as far as the profile overflows there; it costs its producer's work plus the work of its
// inputs that are away (released, or dead) when it is recomputed: Capuchin's lineage, updated after
// every pick, as is the cost of the picks already made that read it. The cover takes candidates
// by overflow covered per second of work, greedily, until no position overflows.
//
// Greedy is lazy: a candidate's coverage only shrinks and its cost only grows as picks are made,
// so a ratio computed earlier bounds it from above; the best candidate is re-scored and taken when
// it still beats the next bound (a priority queue instead of a full rescan per pick).
//
// Only recomputable values made in the step are candidates. The profile is the program's, not the
// runtime's (temporaries inside ops, fragmentation, a recompute's intermediates are not in it):
// the step plan measures each way of planning on the step itself and keeps the better
// (step_trace.h).
#pragma once

#include "step_arrays.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace pymem {

// (position, value): release `value` right after the op at `position`, for the step `s` under
// `budget` bytes. Empty where the profile never overflows.
std::vector<std::pair<int32_t, int32_t>> cover_releases(const StepArrays& s, int64_t budget);

// The work of bringing values back in step `s`: its recorded comebacks, each at its producer's cost.
double comeback_cost(const StepArrays& s);

}  // namespace pymem
