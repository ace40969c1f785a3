// arena.cpp — the budget-sized arena: validation, the allocated-block index, stats, and the
// pressure protocol (search under the lock, release outside it, retry).
#include "arena.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include "window.h"

namespace pymem {

namespace {

// Depth of pressure handlers running on this thread. An allocation that finds no fit while its
// own thread is inside a handler fails at once instead of recursing into the handler.
thread_local int tls_handler_depth = 0;
thread_local CostClass tls_allocation_class = CostClass::Costly;

void check_cost(double cost) {
  if (!(cost >= 0.0) || std::isinf(cost))
    throw InvalidArgument("release cost must be a finite number >= 0, got " + std::to_string(cost));
}

}  // namespace

std::string format_address(uintptr_t a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(a));
  return buf;
}

void check_budget(size_t budget) {
  if (budget < kAlignment)
    throw InvalidArgument("budget must be at least " + std::to_string(kAlignment) +
                          " bytes (the arena's alignment), got " + std::to_string(budget));
  if (budget % kAlignment != 0)
    throw InvalidArgument("budget must be a multiple of " + std::to_string(kAlignment) +
                          " bytes, got " + std::to_string(budget));
}

std::unique_ptr<Arena> make_arena(const std::string& backing, const ArenaConfig& config) {
  check_budget(config.budget);
  if (backing == "host") return std::make_unique<Arena>(make_host_backing(config.budget), config);
  if (backing == "virtual") return std::make_unique<Arena>(make_virtual_backing(config.budget), config);
  throw InvalidArgument("backing must be 'host' or 'virtual' (CUDA arenas live in libpymem_cuda.so), got '" +
                        backing + "'");
}

Arena::Arena(std::unique_ptr<Backing> backing, const ArenaConfig& config)
    : backing_(std::move(backing)), budget_(config.budget), mode_(config.mode) {
  check_budget(budget_);
  if (!backing_ || backing_->size() != budget_ || backing_->base() % kAlignment != 0)
    throw InvalidArgument("backing does not hold exactly the budget at an aligned base");

  small_threshold_ = config.small_threshold;
  size_t small = config.small_region;
  if (small == SIZE_MAX) small = std::min(budget_ / kDefaultSmallRegionShare, kDefaultSmallRegionCap);
  small &= ~(kAlignment - 1);
  if (small_threshold_ == 0 || small + kAlignment > budget_) small = 0;
  if (small == 0) small_threshold_ = 0;

  main_ = std::make_unique<Region>(base(), budget_ - small, RegionKind::Main);
  if (small) small_ = std::make_unique<Region>(base() + budget_ - small, small, RegionKind::Small);
  stats_.budget = budget_;
}

Arena::~Arena() = default;

Block* Arena::try_allocate_locked(size_t rounded, CostClass cls) {
  const bool small = rounded <= small_threshold_;
  if (small) {
    if (Block* b = small_->allocate(rounded, CostClass::Costly)) return b;
  }
  if (!placement_ || small) {  // unplanned; a small one that found its region full stays out of the planned blocks' way
    Block* b = placement_ ? main_->allocate_top(rounded) : main_->allocate(rounded, cls);
    if (b) b->serial = kNoSerial;
    return b;
  }
  const int64_t offset = placement_->planned_offset(rounded);
  Block* b = offset >= 0 ? main_->allocate_at(main_->base() + static_cast<size_t>(offset), rounded) : nullptr;
  const bool placed = b != nullptr;
  if (!b && offset >= 0 && placement_->keeps_plan())
    b = main_->allocate_within(placement_->room_for_displaced(main_->size()), rounded);
  if (!b) b = main_->allocate(rounded, cls);
  if (!b) return nullptr;  // pressure, then this again: the same planned offset
  if (offset >= 0) placement_->count_placed(placed);
  b->serial = placement_->allocated(rounded);
  return b;
}

void Arena::set_step_placement(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (on == (placement_ != nullptr)) return;
  placement_ = on ? std::make_unique<StepPlacement>() : nullptr;
}

bool Arena::step_placement() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return placement_ != nullptr;
}

void Arena::set_step_placement_keeps_plan(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!placement_) throw InvalidArgument("step placement is off: set step_placement = True first");
  placement_->set_keeps_plan(on);
}

void Arena::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!placement_) return;
  std::vector<StepPlacement::Live> live;
  for (const Block* b = main_->first(); b; b = b->next)
    if (b->allocated) live.push_back({b->addr - main_->base(), b->size, b->serial});
  placement_->end_step(live, main_->size());
}

void Arena::end_step(const std::vector<std::pair<uintptr_t, size_t>>& next_start) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!placement_) return;
  std::vector<StepPlacement::Live> live;
  const uintptr_t lo = main_->base(), hi = lo + main_->size();
  for (const auto& [addr, size] : next_start) {
    if (addr < lo || size > hi - lo || addr > hi - size)
      throw InvalidArgument("a span the next step starts with must lie in the main region [" + std::to_string(lo) +
                            ", " + std::to_string(hi) + "), got " + std::to_string(size) + " bytes at " +
                            std::to_string(addr));
    live.push_back({addr - lo, size, kNoSerial});
  }
  placement_->end_step(live, main_->size());
}

std::pair<std::vector<int64_t>, std::vector<size_t>> Arena::step_placement_plan() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!placement_) throw InvalidArgument("step placement is off: set step_placement = True first");
  return {placement_->plan_offsets(), placement_->plan_sizes()};
}

void Arena::set_step_placement_plan(std::vector<int64_t> offsets, std::vector<size_t> sizes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!placement_) throw InvalidArgument("step placement is off: set step_placement = True first");
  if (offsets.size() != sizes.size())
    throw InvalidArgument("a step placement plan needs one size per offset, got " + std::to_string(offsets.size()) +
                          " offsets and " + std::to_string(sizes.size()) + " sizes");
  const size_t region = main_->size();
  for (size_t k = 0; k < sizes.size(); ++k) {
    const size_t size = sizes[k];
    const int64_t at = offsets[k];
    if (size == 0 || size % kAlignment != 0 || size > region)
      throw InvalidArgument("a planned size must be a positive multiple of " + std::to_string(kAlignment) +
                            " up to the main region's " + std::to_string(region) + " bytes, got " + std::to_string(size));
    if (at != -1 && (at < 0 || static_cast<size_t>(at) % kAlignment != 0 || static_cast<size_t>(at) + size > region))
      throw InvalidArgument("a planned offset must be -1 (none) or a multiple of " + std::to_string(kAlignment) +
                            " whose block ends inside the main region's " + std::to_string(region) + " bytes, got " +
                            std::to_string(at) + " for " + std::to_string(size) + " bytes");
  }
  placement_->set_plan(std::move(offsets), std::move(sizes));
}

uintptr_t Arena::allocate(size_t nbytes, CostClass cls, uint64_t owner, double cost, bool pinned) {
  if (nbytes == 0) throw InvalidArgument("allocation size must be at least 1 byte, got 0");
  check_cost(cost);
  std::unique_lock<std::mutex> lock(mutex_);
  if (nbytes > budget_) throw_out_of_budget_locked(nbytes, "the request is larger than the whole budget");
  const size_t rounded = align_up(nbytes);
  bool pressured = false;
  for (;;) {
    if (Block* b = try_allocate_locked(rounded, cls)) {
      b->owner = owner;
      b->cost = cost;
      b->pinned = pinned;
      b->requested = nbytes;
      allocated_.insert(b->addr, b);
      stats_.num_allocs++;
      stats_.allocated_bytes += rounded;
      stats_.requested_bytes += nbytes;
      if (pinned) stats_.pinned_bytes += rounded;
      if (stats_.allocated_bytes > stats_.peak_allocated_bytes)
        stats_.peak_allocated_bytes = stats_.allocated_bytes;
      // Counted as if nothing had been released since mark_op: released bytes made room, they did
      // not shrink what the op needs (a release of more than the request, to find it one block,
      // would otherwise read as a temporary).
      const size_t unreleased = stats_.allocated_bytes + static_cast<size_t>(stats_.released_bytes - op_mark_released_);
      if (unreleased > op_peak_) op_peak_ = unreleased;
      if (history_) history_->record(HistoryEvent::Action::Alloc, b->addr, b->size);
      return b->addr;
    }
    if (!pressured) {
      pressured = true;
      stats_.num_pressure_events++;
      stats_.pressure_free_ratio_sum += double(budget_ - stats_.allocated_bytes) / double(budget_);
    }
    if (!handler_ || tls_handler_depth > 0)
      throw_out_of_budget_locked(nbytes, "no pressure handler can release memory");
    Window w;
    if (mode_.load() != SearchMode::Handler) {
      w = search_locked(rounded);
      if (!w.found) throw_out_of_budget_locked(nbytes, "no releasable window covers the request");
    }
    PressureHandler handler = handler_;
    const uint64_t frees_before = stats_.num_frees, moves_before = stats_.num_moved_blocks;
    lock.unlock();
    {
      struct Depth {  // keeps the counters right if the handler throws
        std::atomic<int>& running;
        explicit Depth(std::atomic<int>& r) : running(r) { ++tls_handler_depth; ++running; }
        ~Depth() { --tls_handler_depth; --running; }
      } depth(handlers_running_);
      handler(rounded, w);
    }
    lock.lock();
    if (stats_.num_frees == frees_before && stats_.num_moved_blocks == moves_before)
      throw_out_of_budget_locked(nbytes, "the pressure handler released nothing");
  }
}

void Arena::throw_out_of_budget_locked(size_t nbytes, const char* why) {
  stats_.num_ooms++;
  const size_t largest = std::max(main_->largest_free(), small_ ? small_->largest_free() : 0);
  // Owners mean something only where the window search reads them; in handler mode the layer
  // above decides what is releasable and keeps no owners here, so the count would mislead.
  std::string unowned_part;
  if (mode_.load() != SearchMode::Handler) {
    size_t unowned = 0;
    allocated_.for_each([&](uintptr_t, const Block* b) {
      if (b->owner == 0) unowned += b->size;
    });
    unowned_part = std::to_string(unowned) + " not releasable (no owner), ";
  }
  std::string msg = "pymem: out of budget: cannot allocate " + std::to_string(nbytes) +
                    " bytes (" + std::to_string(align_up(nbytes)) + " rounded) in a budget of " +
                    std::to_string(budget_) + " bytes: " + std::to_string(stats_.allocated_bytes) +
                    " allocated, " + std::to_string(stats_.pinned_bytes) + " pinned, " + unowned_part +
                    "largest free block " + std::to_string(largest) + " bytes; " + why + ".";
  throw OutOfBudget(msg, nbytes, budget_, stats_.allocated_bytes, stats_.pinned_bytes, largest);
}

Window Arena::search_locked(size_t rounded) {
  const auto t0 = std::chrono::steady_clock::now();
  const SearchMode m = mode_.load();
  Window w = search_window(*main_, rounded, m == SearchMode::Handler ? SearchMode::Window : m);
  stats_.search_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - t0).count();
  stats_.num_searches++;
  return w;
}

Window Arena::find_window(size_t nbytes) {
  if (nbytes == 0) throw InvalidArgument("window size must be at least 1 byte, got 0");
  std::lock_guard<std::mutex> lock(mutex_);
  return search_locked(align_up(nbytes));
}

Block* Arena::find_allocated_locked(uintptr_t addr, const char* what) const {
  if (Block* b = allocated_.find(addr)) return b;
  throw_bad_pointer(addr, what);
}

void Arena::throw_bad_pointer(uintptr_t addr, const char* what) const {
  if (contains(addr))
    throw InvalidArgument(std::string(what) + ": " + format_address(addr) +
                          " is inside this arena but is not the start of an allocated block "
                          "(already freed, or a pointer into the middle of a block)");
  throw InvalidArgument(std::string(what) + ": " + format_address(addr) + " was not allocated by this arena (range " +
                        format_address(base()) + ".." + format_address(base() + budget_) + ")");
}

void Arena::release_block_locked(Block* b) {  // b already taken out of allocated_
  stats_.num_frees++;
  if (handlers_running_.load(std::memory_order_relaxed) > 0) {
    stats_.num_released_blocks++;
    stats_.released_bytes += b->size;
  }
  stats_.allocated_bytes -= b->size;
  stats_.requested_bytes -= b->requested;
  if (b->pinned) stats_.pinned_bytes -= b->size;
  if (history_) history_->record(HistoryEvent::Action::Free, b->addr, b->size);  // before b merges away
  if (placement_ && b->region == RegionKind::Main) placement_->freed(b->serial);
  (b->region == RegionKind::Main ? *main_ : *small_).free(b);
}

void Arena::free(uintptr_t addr) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* b = allocated_.take(addr);
  if (!b) throw_bad_pointer(addr, "free");
  release_block_locked(b);
}

bool Arena::try_free(uintptr_t addr) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* b = allocated_.take(addr);
  if (!b) return false;
  release_block_locked(b);
  return true;
}

void Arena::set_owner(uintptr_t addr, uint64_t owner, double cost) {
  check_cost(cost);
  std::lock_guard<std::mutex> lock(mutex_);
  Block* b = find_allocated_locked(addr, "set_owner");
  b->owner = owner;
  b->cost = cost;
}

void Arena::set_cost(uintptr_t addr, double cost) {
  check_cost(cost);
  std::lock_guard<std::mutex> lock(mutex_);
  find_allocated_locked(addr, "set_cost")->cost = cost;
}

void Arena::set_pinned(uintptr_t addr, bool pinned) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* b = find_allocated_locked(addr, "set_pinned");
  if (b->pinned == pinned) return;
  b->pinned = pinned;
  if (pinned) stats_.pinned_bytes += b->size;
  else stats_.pinned_bytes -= b->size;
}

size_t Arena::block_size(uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return find_allocated_locked(addr, "block_size")->size;
}

CostClass thread_allocation_class() { return tls_allocation_class; }
void set_thread_allocation_class(CostClass cls) { tls_allocation_class = cls; }

size_t Arena::largest_free_block() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return main_->largest_free();
}

size_t Arena::main_free_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return main_->free_bytes();
}

void Arena::set_pressure_handler(PressureHandler handler) {
  std::lock_guard<std::mutex> lock(mutex_);
  handler_ = std::move(handler);
}

ArenaStats Arena::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ArenaStats s = stats_;
  s.num_allocated_blocks = allocated_.size();
  s.num_blocks = main_->num_blocks() + (small_ ? small_->num_blocks() : 0);
  s.free_bytes = main_->free_bytes() + (small_ ? small_->free_bytes() : 0);
  s.largest_free_block = std::max(main_->largest_free(), small_ ? small_->largest_free() : 0);
  if (placement_) {
    s.num_placed_as_planned = placement_->num_placed();
    s.num_displaced_from_plan = placement_->num_displaced();
  }
  return s;
}

void Arena::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
}

Arena::OpMark Arena::mark_op() {
  std::lock_guard<std::mutex> lock(mutex_);
  op_peak_ = stats_.allocated_bytes;
  op_mark_released_ = stats_.released_bytes;
  return {stats_.allocated_bytes, stats_.released_bytes};
}

size_t Arena::transient_since(const OpMark& mark) const {
  std::lock_guard<std::mutex> lock(mutex_);
  // op_peak_ counts released bytes as still held; so does the end here.
  const size_t held = std::max(mark.allocated, stats_.allocated_bytes + static_cast<size_t>(stats_.released_bytes - mark.released));
  return op_peak_ > held ? op_peak_ - held : 0;
}

std::vector<Block> Arena::blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Block> out;
  for (const Region* r : {main_.get(), small_.get()}) {
    if (!r) continue;
    for (const Block* b = r->first(); b; b = b->next) out.push_back(*b);
  }
  return out;
}

void Arena::set_history(size_t max_entries) {
  std::unique_ptr<History> h = max_entries ? std::make_unique<History>(max_entries) : nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  history_ = std::move(h);
}

bool Arena::recording_history() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_ != nullptr;
}

std::vector<HistoryEvent> Arena::history() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_ ? history_->events() : std::vector<HistoryEvent>{};
}

void Arena::label_next_free(uintptr_t addr, std::string label) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (history_) history_->label_next_free(addr, std::move(label));
}

void Arena::label_last_alloc(uintptr_t addr, const std::string& label) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (history_) history_->label_last_alloc(addr, label);
}

void Arena::history_note(HistoryEvent::Action action, uintptr_t addr, size_t size, std::string label) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (history_) history_->note(action, addr, size, std::move(label));
}

}  // namespace pymem
