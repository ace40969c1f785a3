// window.h — choosing what to release under pressure (Coop's sliding window, or one block).
#pragma once

#include "region.h"
#include "types.h"

namespace pymem {

// A block the search may release: a free gap (bytes at cost 0) or an allocated block that has an
// owner and is not pinned. Anything else breaks the window.
inline bool releasable(const Block& b) { return !b.allocated || (b.owner != 0 && !b.pinned); }

// SearchMode::Window: the least-cost run of address-contiguous releasable blocks whose bytes cover
// `need`; ties go to the fewer bytes, then the lower address. O(blocks): two pointers, each block
// enters and leaves the window once.
// SearchMode::OneAtATime: the single allocated releasable block of least cost (ties: larger first),
// whatever its size; the caller releases it and retries.
// Returns found == false when no window covers `need` (or nothing is releasable).
Window search_window(const Region& region, size_t need, SearchMode mode);

}  // namespace pymem
