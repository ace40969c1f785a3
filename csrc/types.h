// types.h — every structure of the pymem arena, documented once.
//
// The arena core (arena.cpp, placement.cpp, window.cpp, backing.cpp) knows nothing of torch or
// Python. Only the allocator hooks (allocator_install.cpp, hook_*.cpp), storage.cpp and the bindings
// include torch/pybind11 headers; cuda_lib.cpp is a plain C-ABI library. Everything here is plain C++17.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace pymem {

// Every block starts and ends on this boundary (PyTorch's CUDA caching allocator rounds the same
// way, and Coop uses it too). Requests are rounded up to it.
constexpr size_t kAlignment = 512;

// Requests of at most this many bytes go to the small region by default (Coop reserves one for
// <= 10 KiB; we round to 16 KiB). Eviction never scans the small region: tiny tensors are too cheap
// to be worth a window, and keeping them out of the main region stops them pinning windows apart.
constexpr size_t kDefaultSmallThreshold = 16 * 1024;
// Default small-region size: budget / 256, at most 64 MiB. A hard budget's bytes there serve no
// large request: the models of bench/vs_checkpoint.py held 148-351 KiB there at 0.3 of their peak,
// a sixth of budget / 64 (and the MILP's MLP at 0.6 needs the rest: its optimum leaves 1.6 MiB).
// A small request that finds it full goes to the main region.
constexpr size_t kDefaultSmallRegionShare = 256;
constexpr size_t kDefaultSmallRegionCap = 64ull << 20;

inline size_t align_up(size_t n) { return (n + kAlignment - 1) & ~(kAlignment - 1); }

// Placement of a block inside the free block chosen by best-fit (cheap-tensor partitioning, Coop):
// outputs of costly ops take the low-address end, cheap ones the high end, so cheap tensors cluster
// and form cheap windows.
enum class CostClass : uint8_t { Costly = 0, Cheap = 1 };

// How the pressure protocol picks what to release: Coop's contiguous window, or the single
// cheapest block (what DTR-style runtimes do; kept so benchmarks compare both on one trace).
// Window: Coop's cheapest contiguous window; OneAtATime: cheapest single block; Handler: no search
// under pressure — the handler decides alone (scored policies) and gets an empty window.
enum class SearchMode : uint8_t { Window = 0, OneAtATime = 1, Handler = 2 };

// Which region of the arena a block lives in.
enum class RegionKind : uint8_t { Main = 0, Small = 1 };

// One block of the arena: either free or allocated. Blocks of a region tile its address range
// exactly, linked in address order (prev/next); no two neighbours are both free (coalesced on free).
// Invariants: addr and size are multiples of kAlignment; size > 0.
// 64 bytes, cache-line aligned: a free touches a block and its two neighbours, one line each.
struct alignas(64) Block {
  uintptr_t addr = 0;
  size_t size = 0;
  Block* prev = nullptr;  // lower-address neighbour in the same region, or null
  Block* next = nullptr;  // higher-address neighbour in the same region, or null
  // Set by the layer above for allocated blocks. owner == 0 means "nobody can release this":
  // the window search treats it like a pinned block.
  uint64_t owner = 0;
  double cost = 0.0;        // release cost (lower = released first); summed over a window
  size_t requested = 0;     // bytes asked for before rounding (stats, snapshots)
  bool allocated = false;
  bool pinned = false;      // must not be released now (e.g. an input of the running op)
  RegionKind region = RegionKind::Main;
  union {
    uint32_t index_pos = 0;  // free blocks: slot in the free index's per-size heap (free_index.h)
    uint32_t serial;         // allocated main-region blocks, while a step placement records (step_placement.h)
  };
};

// A block the pressure handler is asked to release.
struct Victim {
  uint64_t owner;
  uintptr_t addr;
  size_t size;
  double cost;
};

// The result of a window search: a run of address-contiguous blocks [addr, addr + bytes) with no
// pinned or owner-less block inside, whose bytes cover the request, of least total cost. Releasing
// every victim leaves one free block of `bytes` bytes.
struct Window {
  bool found = false;
  uintptr_t addr = 0;
  size_t bytes = 0;
  double cost = 0.0;
  std::vector<Victim> victims;
};

// Counters readable from Python (see Arena::stats). Byte counts are rounded (what the arena holds).
struct ArenaStats {
  size_t budget = 0;
  size_t allocated_bytes = 0, peak_allocated_bytes = 0;
  size_t requested_bytes = 0;
  size_t pinned_bytes = 0;
  size_t num_allocated_blocks = 0, num_blocks = 0;
  size_t largest_free_block = 0, free_bytes = 0;
  uint64_t num_allocs = 0, num_frees = 0;
  uint64_t num_pressure_events = 0;  // allocations that found no fit and asked for release
  uint64_t num_released_blocks = 0;  // blocks freed while a pressure handler ran
  uint64_t released_bytes = 0;       // and their bytes
  uint64_t num_searches = 0;         // window searches run
  uint64_t num_ooms = 0;             // allocations that failed with OutOfBudget
  uint64_t search_ns = 0;            // time spent in window searches
  uint64_t num_compactions = 0;      // compact calls that moved a block, and move_block calls
  uint64_t num_moved_blocks = 0, moved_bytes = 0;  // what compaction moved
  // Coop's fragmentation measure: sum over pressure events of free_bytes / budget.
  double pressure_free_ratio_sum = 0.0;
  // Step placement (step_placement.h): allocations that took their planned offset, and planned
  // ones whose range was taken (placed by best fit instead).
  uint64_t num_placed_as_planned = 0, num_displaced_from_plan = 0;
};

// Which of pymem's CPU allocator hooks holds PyTorch's CPU allocator slot (allocator_install.h).
// At most one at a time: each wraps or replaces the allocator in place, so a second would wrap the
// first, and uninstalling them out of order would restore the wrong one.
//   Arena:     an Arena is the CPU allocator (hook_cpu.h, allocator="arena")
//   Budget:    PyTorch's own CPU allocator, capped at a budget (hook_budget.h, allocator="native")
//   Pluggable: CUDAPluggableAllocator-style alloc/free functions (hook_pluggable.h; tests, on CPU)
enum class CpuHookKind : uint8_t { None = 0, Arena = 1, Budget = 2, Pluggable = 3 };

// Raised when a request cannot be met even after everything releasable was released.
struct OutOfBudget : std::runtime_error {
  size_t requested, budget, allocated, pinned, largest_free;
  OutOfBudget(const std::string& msg, size_t requested, size_t budget, size_t allocated,
              size_t pinned, size_t largest_free)
      : std::runtime_error(msg), requested(requested), budget(budget), allocated(allocated),
        pinned(pinned), largest_free(largest_free) {}
};

// Bad input from the caller (size 0, negative, a budget below the alignment, a bad pointer, a
// double free). Always raised before any state is changed.
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

}  // namespace pymem

static_assert(sizeof(pymem::Block) == 64, "Block should stay one cache line");
