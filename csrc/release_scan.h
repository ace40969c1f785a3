// release_scan.h — the pressure handler's search for the value to release (pressure.py's
// _release_lowest), in C++: the lowest score among every releasable value.
//
// Under pressure the handler scores every candidate for every release: on Hugging Face GPT-2 at a
// third of its peak that is ~150 releases of ~30 candidates per step, and in Python (the policy's
// evaluate reading Record properties that walk the graph) it took 40% of the step. A policy's score
// is data (pymem/policies/base.py): a sum of cost terms over a product of per terms. This scan
// evaluates that same data on the records' C fields, walking the graph the way records.py's
// properties do, term for term and in the same order, so it picks exactly the value the Python
// evaluate would (tests/test_release_scan.py holds it to that).
//
// Terms (TensorView field names):
//   costs: compute_cost (c), evicted_neighbour_cost (e*: neighbourhood.h over the record's input
//          records and live children, in that order), evicted_ancestor_cost (a*: records.py's walk,
//          at most 64 records), last_access
//   per:   nbytes (at least 1), staleness (now - last_access, at least 1e-12), next_use (planned
//          seconds to the next use, at least 1e-12; records.py's _next_use, 8 levels of evicted readers)
// score = (sum of costs, or 1 with none) / (product of per, or 1 with none).
// A planned scan (Planned: its formula reads next_use) scores a value the plan cannot place with the
// fallback formula, and a value read no more this step 0.
//
// Invariants: runs under the GIL and the runtime's lock; reads records, changes none (except what
// the leaf callback does: leaf_releasable sets a leaf's cost).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace pymem {

class EvictedNeighbourhood;  // neighbourhood.h
class StepTrace;             // step_trace.h
struct RecordObject;         // record.h

// A policy's score as data (see above): bit sets of the terms it reads.
struct ScoreFormula {
  enum Cost : uint32_t { kCompute = 1, kNeighbours = 2, kAncestors = 4, kLastAccess = 8 };
  enum Per : uint32_t { kBytes = 1, kStaleness = 2, kNextUse = 4 };
  uint32_t costs = 0;
  uint32_t per = 0;
  // The block cost Coop's window search sums: max(score, 0) times the bytes (most policies), or
  // max(score, 0) alone (a policy whose score is already per block: coop, lru, size).
  bool block_per_byte = true;
};

// What one scan reads besides the records.
struct ScanInputs {
  double now = 0;
  ScoreFormula formula;           // the policy's
  ScoreFormula fallback;          // a planned formula's, for values the plan cannot place
  const StepTrace* plan = nullptr;  // the step trace, when the formula reads next_use
  EvictedNeighbourhood* neighbourhood = nullptr;  // null: e* reads 0 (no neighbourhood kept)
  double link_bandwidth = 1;      // bytes/s of a host copy (a* of an offloaded ancestor)
  PyObject* cache = nullptr;      // {record: (StorageRef, tensor)}: values recomputed only as inputs
};

// Whether a leaf (a record with no recipe) may be released, as Residency.leaf_releasable says:
// `rule` is None (no leaf may go), a float (every leaf may go, the host pool having no cap: the
// leaf's cost is set to its copy out and back at that many bytes/s, as leaf_releasable sets it),
// or leaf_releasable itself, called. The float keeps the scans off Python: they ask it of every
// leaf (parameters, gradients, optimizer state) at every release under pressure.
bool leaf_may_go(pybind11::handle rule, PyObject* record);

// The record to release now: the lowest score among the records of `table` ({key: record}) that
// are in memory in the arena and free to go (no locks, waits or pins; a recipe, or a leaf for which
// `leaf_ok(record)` is true: leaf_ok None means no leaf may go), then the cache's records with a
// recipe and no locks or waits. Of equal scores the oldest record (lowest id) wins: the table's order
// follows storage addresses, which the heap reuses differently from run to run. None when there is
// no candidate.
pybind11::object lowest_scoring(pybind11::dict table, const ScanInputs& in, pybind11::handle leaf_ok);

class Arena;  // arena.h

// Coop's window search over the arena (pressure.py's _release_window): every block of a value that
// must stay gets owner 0 (resets a window), every candidate (as lowest_scoring picks them) in
// [lo, hi) gets its record id as owner and its block cost. Returns {id: record} of the candidates
// marked. `leaf_ok` as above.
pybind11::dict mark_window_owners(Arena& arena, pybind11::dict table, const ScanInputs& in, pybind11::handle leaf_ok,
                                  uintptr_t lo, uintptr_t hi);

// Every candidate lowest_scoring looks at, as [(address, record)], lowest score first (of equal
// scores the lowest id): the order releases would take them in, for pricing the release path
// against compaction (pressure.py's _moves_cheaper) without a Python loop over the table.
pybind11::list ranked_candidates(pybind11::dict table, const ScanInputs& in, pybind11::handle leaf_ok);

// The score of each record of `records` (an iterable of records), as lowest_scoring scores it:
// compaction ranks a segment's releasable values with these.
pybind11::list score_all(pybind11::handle records, const ScanInputs& in);

}  // namespace pymem
