// movable.h — which arena blocks may move now (runtime/compaction.py's movable_blocks, in C++).
//
// Compaction plans over the blocks that may move, and the pressure handler asks for them at every
// request it considers compacting for: in Python the walk over every record of the table (and a
// leaf check per leaf) cost about a tenth of the handler's host time on Hugging Face GPT-2.
//
// A block may move when its value is in memory (not evicted), pinned by nothing outside torch
// (pins), lies in [lo, hi) (the main region) and no running kernel reads it (`busy`). It may be
// released too when the value is in the arena, no op holds it (locks), and it has a recipe or is a
// leaf `leaf_ok` lets go. The recompute cache's values follow the table's (a cached value has a
// recipe); an address met twice keeps the later entry, as the Python dict did.
//
// Invariants: under the GIL and the runtime's lock; reads records (leaf_ok may write a leaf's cost).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace pymem {

// {addr: (record, StorageRef, releasable)}. `table`: {key: record}; `cache`: {record: (StorageRef,
// tensor)}; `busy`: addresses that may not move; `leaf_ok`: whether a leaf may be released, as
// release_scan.h's leaf_may_go reads it (None: none may).
pybind11::dict movable_blocks(pybind11::dict table, pybind11::dict cache, uintptr_t lo, uintptr_t hi,
                              const std::vector<uintptr_t>& busy, pybind11::handle leaf_ok);

// The addresses of those blocks alone, in the same walk: what the moves-only question (the arena's
// plan_moves) reads. The pressure handler asks it at most new requests and usually answers
// "release"; the dict's tuples and StorageRefs cost most of its walk, and are made only when the
// answer is "move" (movable_blocks then).
std::vector<uintptr_t> movable_addresses(pybind11::dict table, pybind11::dict cache, uintptr_t lo, uintptr_t hi,
                                         const std::vector<uintptr_t>& busy);

}  // namespace pymem
