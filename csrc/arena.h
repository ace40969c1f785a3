// arena.h — one range of exactly `budget` bytes, cut into address-ordered blocks.
//
// Layout: [ main region ........................ | small region ]
//   main  — best-fit by (size, address), split on allocate (placement.cpp decides which end),
//           coalesce on free; the only region the window search (window.cpp) scans.
//   small — requests <= small_threshold; never scanned by eviction. When it is full, small
//           requests fall back to the main region.
//
// Pressure protocol: a request that finds no fit runs the window search under the lock, drops the
// lock, and calls the pressure handler with the request and the window. The handler releases
// blocks (freeing into this arena from inside it is safe) and the arena retries. If the handler
// frees nothing, or there is no window, allocation throws OutOfBudget. The budget is never exceeded:
// the arena cannot grow.
//
// Thread safety: one mutex per arena guards all block state. It is never held while the handler
// runs, so a handler may take other locks (the GIL) without deadlock.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "addr_map.h"
#include "backing.h"
#include "history.h"
#include "region.h"
#include "step_placement.h"
#include "types.h"

namespace pymem {

using PressureHandler = std::function<void(size_t request, const Window& window)>;

struct ArenaConfig {
  size_t budget = 0;
  size_t small_threshold = kDefaultSmallThreshold;  // 0 disables the small region
  size_t small_region = SIZE_MAX;                   // SIZE_MAX: budget / 256, at most 64 MiB
  SearchMode mode = SearchMode::Window;
};

class Arena {
 public:
  // Throws InvalidArgument if the budget is below kAlignment or not what the backing holds.
  Arena(std::unique_ptr<Backing> backing, const ArenaConfig& config);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Returns the address of a block of at least `nbytes` (rounded up to kAlignment).
  // Throws InvalidArgument for nbytes == 0, OutOfBudget when it cannot be met.
  uintptr_t allocate(size_t nbytes, CostClass cls = CostClass::Costly, uint64_t owner = 0,
                     double cost = 0.0, bool pinned = false);
  // Throws InvalidArgument if `addr` is not the start of an allocated block of this arena.
  void free(uintptr_t addr);
  // Like free, but returns false instead of throwing (for deleters, which must not throw).
  bool try_free(uintptr_t addr) noexcept;

  void set_owner(uintptr_t addr, uint64_t owner, double cost);
  void set_cost(uintptr_t addr, double cost);
  void set_pinned(uintptr_t addr, bool pinned);
  // Size of the allocated block at addr (rounded). Throws InvalidArgument if none.
  size_t block_size(uintptr_t addr) const;
  // The largest free block of the main region (where requests above small_threshold go). A
  // speculative allocation (prefetch) asks for less than this minus a margin: it never causes an
  // eviction, and never takes the arena's last contiguous room.
  size_t largest_free_block() const;
  // The main region's free bytes, in however many blocks. Where they cover a request that does not
  // fit, the shortfall is fragmentation alone: compaction can place it without releasing anything.
  size_t main_free_bytes() const;

  // Compaction (compact.cpp): slides each listed block (allocated, main region, not pinned) up to
  // the highest address it can reach without passing a block that is not listed, moving its bytes
  // (Backing::move) — so the free bytes between unlisted blocks end up as one block at the bottom.
  // Returns (old, new) address pairs for the blocks that moved; the caller repoints their owners.
  // A call from a pressure handler counts as progress. Throws InvalidArgument, before changing
  // anything, for an address that is not such a block or a backing that cannot move bytes.
  std::vector<std::pair<uintptr_t, uintptr_t>> compact(const std::vector<uintptr_t>& addrs);
  // Moves one allocated main-region block (not pinned) to `to`, which with the block's size must lie
  // inside one free block of the main region; copies its bytes and frees the old range. Same rules.
  void move_block(uintptr_t from, uintptr_t to);
  // The stream the next moves are ordered on (a cudaStream_t; 0: the legacy default stream). Only a
  // CUDA backing reads it.
  void set_move_stream(uintptr_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    backing_->set_move_stream(reinterpret_cast<void*>(stream));
  }

  // The window the pressure protocol would choose for `nbytes` now (does not release anything).
  Window find_window(size_t nbytes);
  void set_pressure_handler(PressureHandler handler);
  SearchMode mode() const { return mode_.load(); }
  void set_mode(SearchMode mode) { mode_.store(mode); }

  // Step placement (step_placement.h): while on, each training step's large blocks go where the
  // step before showed they block nothing later. end_step() marks a step's end (the runtime's step
  // trace); turning it off forgets what was learned.
  void set_step_placement(bool on);
  bool step_placement() const;
  // Whether the step now starting keeps its placement plan through a displacement (on by default;
  // step_placement.h). Throws InvalidArgument when placement is off.
  void set_step_placement_keeps_plan(bool on);
  void end_step();
  // The same, planning around `next_start` (address, size: main-region spans) as the blocks the
  // next step starts with and keeps, instead of the blocks allocated now: for a replay that starts
  // every step afresh (the simulator's). Throws InvalidArgument for a span outside the main region.
  void end_step(const std::vector<std::pair<uintptr_t, size_t>>& next_start);
  // The plan for the next step (offsets, -1 for none, and sizes per allocation index), and one
  // taken over from another arena. Throws InvalidArgument when placement is off or the plan does
  // not fit this arena's main region.
  std::pair<std::vector<int64_t>, std::vector<size_t>> step_placement_plan() const;
  void set_step_placement_plan(std::vector<int64_t> offsets, std::vector<size_t> sizes);

  ArenaStats stats() const;
  void reset_peak();

  // An op's temporaries, for the step trace (step_trace.h's op_transient): mark_op() before its
  // kernel, transient_since() after it. The bytes allocated at the kernel's peak above both what
  // it started and what it ended with, every byte pressure released meanwhile counted as still
  // held (that room was made for the op; a release can free more than a request needs, to make
  // it one block). Why: a convolution's backward holds up to 32 MiB of workspace beside its
  // outputs, which a plan that counts only values does not see. One mark per arena: where threads
  // allocate at once, each measure includes the others' (a plan's estimate, no more).
  struct OpMark {
    size_t allocated;
    uint64_t released;
  };
  OpMark mark_op();
  size_t transient_since(const OpMark& mark) const;
  std::vector<Block> blocks() const;  // copies, address order (main region, then small)

  // The opt-in event log (history.h): max_entries > 0 starts a fresh one, 0 stops recording.
  void set_history(size_t max_entries);
  bool recording_history() const;
  std::vector<HistoryEvent> history() const;  // oldest first; empty when not recording
  void label_next_free(uintptr_t addr, std::string label);  // no-ops when not recording
  void label_last_alloc(uintptr_t addr, const std::string& label);
  void history_note(HistoryEvent::Action action, uintptr_t addr, size_t size, std::string label);

  uintptr_t base() const { return backing_->base(); }
  size_t budget() const { return budget_; }
  size_t small_threshold() const { return small_threshold_; }
  size_t small_region_size() const { return small_ ? small_->size() : 0; }
  const char* backing_kind() const { return backing_->kind(); }
  bool contains(uintptr_t addr) const { return addr >= base() && addr < base() + budget_; }

 private:
  Block* try_allocate_locked(size_t rounded, CostClass cls);
  Block* find_allocated_locked(uintptr_t addr, const char* what) const;
  [[noreturn]] void throw_bad_pointer(uintptr_t addr, const char* what) const;
  Window search_locked(size_t rounded);
  [[noreturn]] void throw_out_of_budget_locked(size_t nbytes, const char* why);
  void release_block_locked(Block* b);
  Block* movable_block_locked(uintptr_t addr, const char* what) const;  // compact.cpp
  Block* relocate_locked(Block* b, Block* fb, uintptr_t to);

  std::unique_ptr<Backing> backing_;
  size_t budget_;
  size_t small_threshold_;
  std::unique_ptr<Region> main_, small_;
  AddrMap allocated_;  // start address -> allocated block
  mutable std::mutex mutex_;
  PressureHandler handler_;
  std::atomic<SearchMode> mode_;
  std::atomic<int> handlers_running_{0};  // frees while > 0 count as released blocks
  ArenaStats stats_;
  size_t op_peak_ = 0;             // since the last mark_op: the peak of allocated + released bytes
  uint64_t op_mark_released_ = 0;  // released_bytes at that mark
  std::unique_ptr<History> history_;  // null: not recording
  std::unique_ptr<StepPlacement> placement_;  // null: best fit alone
};

}  // namespace pymem

namespace pymem {
// Builds an arena over a new backing ("host", "virtual"); validates the budget before mapping.
std::unique_ptr<Arena> make_arena(const std::string& backing, const ArenaConfig& config);
// Throws InvalidArgument unless `budget` can back an arena (>= and a multiple of kAlignment).
void check_budget(size_t budget);
// "0x..." for error messages.
std::string format_address(uintptr_t addr);
// The placement class of this thread's allocations through the allocator hooks (which cannot pass
// one): Costly unless the runtime says otherwise around an allocation (prefetch buffers are Cheap:
// a host copy makes them free to release, so they belong with the cheap blocks).
CostClass thread_allocation_class();
void set_thread_allocation_class(CostClass cls);

}  // namespace pymem
