// sweep.h — dropping the records of storages that died (Runtime.sweep's scan, in C++).
//
// The runtime's table maps a storage key to the record of its current value and never learns when
// a storage dies (records hold their storages weakly). Every few thousand new records the runtime
// sweeps: the scan of the whole table is here, so that its cost per op stays a few nanoseconds.
#pragma once

#include <pybind11/pybind11.h>

namespace pymem {

// Removes from `table` ({key: Record}) every record whose storage died and drops them youngest
// first: each loses its host copy, and `mark_gone(r)` (None: skipped) is called for one that some
// live record's recipe still reads, before any older one is looked at (one dropped is no longer a
// live reader of its inputs). Then, for every record left: a `children` list over 64 entries loses
// its dead weakrefs, and a `hold` whose tensor died is cleared. Returns (record, may_pay) for each
// record left that only recipes hold (an unpinned leaf whose hold tensor is its storage's only
// holder); may_pay: remat.release_orphaned_leaf would drop its readers' recipes in the graph as it
// stands now (its walk, over `cache`, the runtime's recompute cache). That is the graph before any
// of them is dropped: the caller asks Python of each leaf after the first it drops. The sweep runs
// at every new request under pressure, and most leaves are held elsewhere or kept by their
// readers: deciding them here keeps Python off the loop.
pybind11::list sweep_records(pybind11::dict table, pybind11::object mark_gone, pybind11::dict cache);

}  // namespace pymem
