// bench.h — tight C++ loops behind bench/alloc_bench.py (a Python loop would measure Python).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pymem {

// Mean ns per allocate+free pair on a virtual arena holding `live_blocks` live blocks of random
// sizes (log-uniform 512 B .. 256 KiB): each pair frees a random live block and allocates a new one.
double bench_arena_pairs(size_t live_blocks, size_t pairs, uint64_t seed);
// The same pattern against glibc malloc/free.
double bench_malloc_pairs(size_t live_blocks, size_t pairs, uint64_t seed);
// Mean us per window search over an arena of `blocks` blocks (owned, random costs, a free gap
// every few blocks, a pinned block now and then) for a request of about four blocks.
double bench_window_search(size_t blocks, size_t searches, uint64_t seed);

}  // namespace pymem
