// plan_cover.h — which values a step releases, chosen from the whole step at once (Capuchin's
// guided mode: measure the step, find where it overflows the budget, pick what to recompute there).
//
// The live bytes of a step that releases nothing are known from its trace: a value occupies its
// bytes from its producer to its death (its last use, or where the program freed it; values made
// before the step: the whole step), and an op's temporaries (op_transient) occupy theirs at the op.
// Where that profile is above the budget, some values must be
// away. A candidate is one value away across one gap between two of its uses (or its producer and
// first use; or, a tail, from its last use to its death: that one costs nothing): released right
// after the earlier op, rerun for the later one. It frees its bytes over the gap, where they count
// only as far as the profile overflows there. A cover takes candidates by overflow covered per
// second of work, greedily, until no position overflows. Two covers differ in what a rerun costs:
//
// cover_releases (lineage): the work of the value's producer and of every input away (released,
// or dead) at the rerun: Capuchin's lineage, updated after every pick, as is the cost of the picks
// already made that read it. Those inputs count as away still after the rerun; the runtime in
// fact keeps what it rebuilt until pressure takes it.
//
// rebuild_releases (rebuild): the runtime's restore, planned. A dead input is rerun for that op
// only; one still away is rerun and then, as the runtime keeps it, stays, its stretch cut short
// there, where its bytes fit until it was due back; where they do not, it goes again right after
// (an extra rerun, and a planned release at a position that does not read it). A candidate whose
// gap holds a rerun that reads it is away until then and stays, or away across the whole gap and
// back for each such rerun (whichever covers more per second). Its profile is then what the
// runtime will see up to a rerun's temporaries (its dead inputs, its kernel's) and fragmentation.
//
// Neither wins everywhere (fixed op costs, bench/plan_ways.py and bench/milp_optimum.py): on the
// MILP's 6-layer MLP at 0.6 of its peak, rebuild 1.99 ms of recompute against the release-only
// optimum's 1.71 (it rebuilds the chain once and keeps part of it), lineage 1.71 (of its covers
// of the budget and of 0.98 and 0.96 of it, the cheapest by its own prices: cover_releases); on a
// 16-layer chain with room for four activations, lineage 27 and rebuild 38 (its picks, made from
// the longest gaps first, leave each backward rerun nothing to keep); on the transformers and CNN of
// bench/vs_checkpoint.py, within 10% of each other either way. The step plan measures each on
// the step itself and keeps the cheapest way (plan_choice.h).
//
// Greedy keeps what it took, though later picks may cover an earlier one's overflow on their own
// (a small value taken first for its ratio, a larger one later for what was left). So each cover
// ends with a pass that drops picks, dearest comeback first, where the live bytes stay within the
// budget less 3% across the gap without them (bench/plan_ways.py, measured op costs: rebuild at
// the transformer's checkpointed peak 0.0545 -> 0.0530 s of recompute a step, at 0.5 of its peak
// 0.0307 -> 0.0260). With no slack left, a pruned plan fills the budget to its last bytes and
// placement pays: the transformer's rebuild at its checkpointed peak moved 22-110 MiB a step in
// compactions instead of 0-8. (With no slack the lineage cover on deep at 0.3 did gain, 0.0949 ->
// 0.0868 s and 12 -> 2 MiB moved; with 3% it plans as before there.)
//
// Greedy is lazy: a candidate's ratio computed earlier is taken as an upper bound; the best is
// re-scored and taken when it still beats the next bound (a priority queue instead of a full rescan
// per pick). In rebuild, a rerun that keeps a value raises the overflow again where it stays:
// candidates that covered nothing there are scored again.
//
// Only recomputable values made in the step are candidates.
//
// Callers pass the main region's bytes as the budget (the runtime's StepTrace.budget, sim/plan.py):
// the small region's serve no large request, and a cover of the whole budget left a one-layer
// TinyGPT at 0.8 of its peak a megabyte short, which the pressure handler took unplanned (the
// attention's softmax, rerun with its scores and mask: 0.076 ms of recompute against 0.043).
#pragma once

#include "step_arrays.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace pymem {

// (position, value): release `value` right after the op at `position`, for the step `s` under
// `budget` bytes. Empty where the profile never overflows. cover_releases prices each comeback
// with its lineage (and keeps the cheapest by those prices of its covers of the budget and of
// 0.98 and 0.96 of it: greedy turns on near ties); rebuild_releases plans what reruns rebuild.
std::vector<std::pair<int32_t, int32_t>> cover_releases(const StepArrays& s, int64_t budget);
std::vector<std::pair<int32_t, int32_t>> rebuild_releases(const StepArrays& s, int64_t budget);

// The work of bringing values back in step `s`: its recorded comebacks, each at its producer's cost.
double comeback_cost(const StepArrays& s);

}  // namespace pymem
