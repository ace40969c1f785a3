// cuda_lib.cpp — libpymem_cuda.so: one pymem::Arena per CUDA device behind a C ABI that PyTorch's
// CUDAPluggableAllocator loads. See cuda_lib.h for the contract; this file adds stream-ordered
// frees (events, a pending list) on top of the arena.
//
// Locking: one library mutex (State::mu) guards the per-device maps below. It may be held while
// calling into an arena (lock order: library, then arena; the arena never calls back under its own
// lock) but never across Arena::allocate, which may run the pressure handler, whose frees come back
// here and take the library mutex.
#include "cuda_lib.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "arena.h"
#include "backing.h"
#include "types.h"

namespace {

using pymem::Arena;

constexpr unsigned kEventDisableTiming = 0x02;  // cudaEventDisableTiming: cheaper to record

thread_local std::string t_last_error;
thread_local int t_last_code = PYMEM_CUDA_OK;

int fail(int code, std::string msg) {
  t_last_error = std::move(msg);
  t_last_code = code;
  return code;
}

using pymem::format_address;

// What the library knows about a live (allocated, not yet freed) block.
struct BlockInfo {
  const pymem_block_provider* provider = nullptr;  // null: the device's own arena
  size_t size = 0;                  // rounded bytes
  uint64_t owner = 0;               // mirrors the arena's, for pymem_cuda_free_owned
  void* alloc_stream = nullptr;
  std::vector<void*> other_streams;  // recorded with pymem_cuda_record_stream
};

// A freed block waiting for the work of the streams that used it.
struct PendingFree {
  const pymem_block_provider* provider = nullptr;
  uintptr_t addr = 0;
  size_t size = 0;
  std::vector<void*> events;  // not yet seen complete
  // An event could not be created or recorded, so completion cannot be observed: the block is
  // never handed out again (a leak of one block beats a use-after-free on the GPU).
  bool stuck = false;
};

struct Device {
  int index = 0;
  std::shared_ptr<Arena> arena;
  const pymem_block_provider* provider = nullptr;  // set: new blocks come from it, not the arena
  bool has_primary = false;
  void* primary = nullptr;
  std::unordered_map<uintptr_t, BlockInfo> live;
  std::vector<PendingFree> pending;
  size_t pending_bytes = 0;
  std::vector<void*> spare_events;  // completed events, reused (creating one costs a driver call)
  uint64_t bad_frees = 0;
  uint64_t ooms = 0;
};

struct State {
  std::mutex mu;
  bool configured = false;
  pymem::ArenaConfig config;
  // The copy of the table given to pymem_cuda_set_table. Never freed: pymem_cuda_runtime_table
  // hands it out for the life of the process.
  const pymem_cuda_table* custom_table = nullptr;
  const pymem_cuda_table* active = nullptr;  // what the arenas use; set with the first arena
  // Copies given to pymem_cuda_set_provider, never freed: blocks point at the one that made them.
  std::vector<std::unique_ptr<pymem_block_provider>> providers;
  pymem_pressure_fn pressure_fn = nullptr;
  void* pressure_ctx = nullptr;
  std::map<int, std::unique_ptr<Device>> devices;
};

// Never destroyed: PyTorch frees tensors during interpreter shutdown, after static destructors
// would have run.
State& state() {
  static State* s = new State;
  return *s;
}

bool any_arena_locked(const State& s) {
  for (const auto& kv : s.devices)
    if (kv.second->arena) return true;
  return false;
}

Device* find_device_locked(State& s, int device) {
  auto it = s.devices.find(device);
  return it == s.devices.end() ? nullptr : it->second.get();
}

Device& get_device_locked(State& s, int device) {
  auto& slot = s.devices[device];
  if (!slot) {
    slot = std::make_unique<Device>();
    slot->index = device;
  }
  return *slot;
}

// An event on `d`'s device: from the spare list, or created with the device made current (events
// belong to the device current at creation; frees may come from a thread on another device).
int acquire_event_locked(State& s, Device& d, void** ev) {
  if (!d.spare_events.empty()) {
    *ev = d.spare_events.back();
    d.spare_events.pop_back();
    return 0;
  }
  const pymem_cuda_table* t = s.active;
  int prev = -1;
  int err = t->get_device(&prev);
  if (err == 0 && prev != d.index) err = t->set_device(d.index);
  if (err != 0) return err;
  *ev = nullptr;
  err = t->event_create(ev, kEventDisableTiming);
  if (prev != d.index) t->set_device(prev);
  return err;
}

// Gives a freed block back to where it came from.
void release_block_locked(Device& d, const pymem_block_provider* provider, uintptr_t addr) {
  if (provider)
    provider->free(provider->ctx, addr, d.index);
  else
    d.arena->try_free(addr);
}

void release_pending_locked(Device& d, size_t i) {
  PendingFree& p = d.pending[i];
  release_block_locked(d, p.provider, p.addr);
  d.pending_bytes -= p.size;
  if (i + 1 != d.pending.size()) d.pending[i] = std::move(d.pending.back());
  d.pending.pop_back();
}

// Returns to the arena every pending block whose events have all completed; never blocks.
size_t poll_pending_locked(State& s, Device& d) {
  size_t released = 0;
  for (size_t i = 0; i < d.pending.size();) {
    PendingFree& p = d.pending[i];
    if (!p.stuck) {
      while (!p.events.empty()) {
        // NOT_READY means still running; any other error leaves it pending too (safe side).
        if (s.active->event_query(p.events.back()) != 0) break;
        d.spare_events.push_back(p.events.back());
        p.events.pop_back();
      }
      if (p.events.empty()) {
        release_pending_locked(d, i);
        ++released;
        continue;
      }
    }
    ++i;
  }
  return released;
}

// Waits for every pending free of `d` and returns the blocks to the arena (the cheapest release
// there is: nobody needs those bytes any more). Holds the library mutex while the host waits; this
// only happens on the out-of-room path.
size_t sync_pending_locked(State& s, Device& d) {
  size_t released = 0;
  for (size_t i = 0; i < d.pending.size();) {
    PendingFree& p = d.pending[i];
    if (p.stuck) {
      ++i;
      continue;
    }
    // An error here means the context is gone; nothing will touch the block again either way.
    for (void* ev : p.events) {
      s.active->event_synchronize(ev);
      d.spare_events.push_back(ev);
    }
    p.events.clear();
    release_pending_locked(d, i);
    ++released;
  }
  return released;
}

void destroy_events_locked(State& s, Device& d) {
  for (auto& p : d.pending)
    for (void* ev : p.events) s.active->event_destroy(ev);
  for (void* ev : d.spare_events) s.active->event_destroy(ev);
  d.spare_events.clear();
  d.pending.clear();
  d.pending_bytes = 0;
}

// Makes `waiter` wait for the work queued on `d`'s primary stream so far.
int order_after_primary_locked(State& s, Device& d, void* waiter) {
  void* ev = nullptr;
  int err = acquire_event_locked(s, d, &ev);
  if (err != 0) return err;
  err = s.active->event_record(ev, d.primary);
  if (err == 0) err = s.active->stream_wait_event(waiter, ev, 0);
  // Safe to reuse at once: a wait captures the work recorded at the time of the call.
  d.spare_events.push_back(ev);
  return err;
}

// The arena's PressureHandler for `device` (called by the arena without its lock).
void on_pressure(int device, size_t request, const pymem::Window& window) {
  State& s = state();
  pymem_pressure_fn fn;
  void* ctx;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    Device* d = find_device_locked(s, device);
    if (!d || !d->arena) return;
    // Blocks already freed but waiting for their streams go first: releasing them costs nothing.
    if (sync_pending_locked(s, *d) > 0) return;  // the arena retries with them back
    fn = s.pressure_fn;
    ctx = s.pressure_ctx;
  }
  if (!fn) return;
  std::vector<pymem_victim> victims;
  victims.reserve(window.victims.size());
  for (const pymem::Victim& v : window.victims)
    victims.push_back({v.owner, static_cast<uint64_t>(v.addr), static_cast<uint64_t>(v.size), v.cost});
  fn(device, request, victims.data(), victims.size(), ctx);
  // Victims used on other streams went to the pending list: wait for them so the retry sees them.
  std::lock_guard<std::mutex> lock(s.mu);
  if (Device* d = find_device_locked(s, device); d && d->arena) sync_pending_locked(s, *d);
}

void install_handler(Arena& arena, int device, bool on) {
  if (on)
    arena.set_pressure_handler(
        [device](size_t request, const pymem::Window& w) { on_pressure(device, request, w); });
  else
    arena.set_pressure_handler(nullptr);
}

// The CUDA runtime table in use: the custom one, or libcudart loaded now.
int ensure_table_locked(State& s) {
  if (s.active) return 0;
  if (s.custom_table) {
    s.active = s.custom_table;
    return 0;
  }
  std::string err;
  s.active = pymem::load_cuda_runtime(&err);
  return s.active ? 0 : fail(PYMEM_CUDA_E_CUDA, err);
}

// The arena of `device`, created (with its CUDA slab) on first use.
int ensure_arena_locked(State& s, Device& d) {
  if (d.arena) return 0;
  if (!s.configured)
    return fail(PYMEM_CUDA_E_STATE,
                "pymem: pymem_cuda_configure(budget, ...) must be called before the first CUDA "
                "allocation (device " + std::to_string(d.index) + ")");
  if (int err = ensure_table_locked(s)) return err;
  try {
    auto arena = std::make_shared<Arena>(pymem::make_cuda_backing(s.config.budget, d.index, s.active),
                                         s.config);
    install_handler(*arena, d.index, s.pressure_fn != nullptr);
    d.arena = std::move(arena);
  } catch (const pymem::InvalidArgument& e) {
    return fail(PYMEM_CUDA_E_INVALID, e.what());
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& e) {  // cudaMalloc of the slab failed
    return fail(PYMEM_CUDA_E_CUDA, e.what());
  }
  return 0;
}

int internal_error(const char* where, const char* what) {
  return fail(PYMEM_CUDA_E_INTERNAL, std::string("pymem: internal error in ") + where + ": " + what);
}

// Runs `body` (returning a code), turning any exception into an error code.
template <class F>
int guarded(const char* where, F&& body) noexcept {
  try {
    return body();
  } catch (const pymem::InvalidArgument& e) {
    return fail(PYMEM_CUDA_E_INVALID, std::string("pymem: ") + e.what());
  } catch (const pymem::OutOfBudget& e) {
    return fail(PYMEM_CUDA_E_OOM, e.what());
  } catch (const std::bad_alloc&) {
    return internal_error(where, "out of host memory");
  } catch (const std::exception& e) {
    return internal_error(where, e.what());
  } catch (...) {
    return internal_error(where, "unknown exception");
  }
}

std::string bad_free_message(const Device& d, uintptr_t addr) {
  for (const PendingFree& p : d.pending)
    if (p.addr == addr)
      return "pymem: free of " + format_address(addr) + " on device " + std::to_string(d.index) +
             ": already freed (double free; its first free is still waiting for its streams)";
  if (!d.arena)
    return "pymem: free of " + format_address(addr) + " on device " + std::to_string(d.index) +
           ": not a live block of this device (already freed, or not allocated by pymem)";
  if (d.arena->contains(addr))
    return "pymem: free of " + format_address(addr) + " on device " + std::to_string(d.index) +
           ": not the start of a live block of this device's arena (already freed, or a pointer "
           "into the middle of a block)";
  return "pymem: free of " + format_address(addr) + " on device " + std::to_string(d.index) +
         ": not allocated by pymem (arena range " + format_address(d.arena->base()) + ".." +
         format_address(d.arena->base() + d.arena->budget()) + ")";
}

// owner == nullptr: any live block; otherwise only a live block of that owner (a victim whose
// address may have been released and handed out again since the window was chosen).
int free_impl(void* ptr, int device, const uint64_t* owner = nullptr) {
  if (!ptr) return 0;
  State& s = state();
  const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(s.mu);
  Device* d = find_device_locked(s, device);
  if (!d || (!d->arena && d->live.empty() && d->pending.empty()))
    return fail(PYMEM_CUDA_E_INVALID, "pymem: free of " + format_address(addr) + " on device " +
                                          std::to_string(device) + ", which has no pymem blocks");
  auto it = d->live.find(addr);
  if (owner && (it == d->live.end() || it->second.owner != *owner))
    return fail(PYMEM_CUDA_E_INVALID, "pymem: free of " + format_address(addr) + " on device " +
                                          std::to_string(device) + ": no live block of owner " +
                                          std::to_string(*owner) + " there (already released)");
  if (it == d->live.end()) {
    ++d->bad_frees;
    return fail(PYMEM_CUDA_E_INVALID, bad_free_message(*d, addr));
  }
  BlockInfo info = std::move(it->second);
  d->live.erase(it);

  // Every stream that may still have work on the block.
  std::vector<void*> users;
  users.reserve(2 + info.other_streams.size());
  users.push_back(info.alloc_stream);
  for (void* st : info.other_streams)
    if (std::find(users.begin(), users.end(), st) == users.end()) users.push_back(st);

  if (d->has_primary && users.size() == 1 && users[0] == d->primary) {
    release_block_locked(*d, info.provider, addr);  // ordered behind the primary stream's work
    return 0;
  }

  PendingFree p;
  p.provider = info.provider;
  p.addr = addr;
  p.size = info.size;
  if (!info.provider) {
    // The owner has let go: the block must not be offered as a victim (nor count as pinned) while
    // it waits.
    d->arena->set_owner(addr, 0, 0.0);
    d->arena->set_pinned(addr, false);
  }
  int err = 0;
  for (void* st : users) {
    void* ev = nullptr;
    err = acquire_event_locked(s, *d, &ev);
    if (err != 0) break;
    p.events.push_back(ev);
    err = s.active->event_record(ev, st);
    if (err != 0) break;
  }
  if (err != 0) p.stuck = true;
  d->pending_bytes += p.size;
  d->pending.push_back(std::move(p));
  if (err != 0)
    return fail(PYMEM_CUDA_E_CUDA, "pymem: free of " + format_address(addr) + " on device " +
                                       std::to_string(device) + ": recording its stream event failed "
                                       "with CUDA error " + std::to_string(err) +
                                       "; the block is kept out of use");
  return 0;
}

// Runs body(arena, addr, info) on the live block at ptr, under the library lock.
// Blocks of a provider have no arena here: `arena_only` calls refuse them.
template <class F>
int with_live_block(const char* what, void* ptr, int device, bool arena_only, F&& body) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  Device* d = find_device_locked(s, device);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
  auto it = d ? d->live.find(addr) : std::unordered_map<uintptr_t, BlockInfo>::iterator();
  if (!d || it == d->live.end())
    return fail(PYMEM_CUDA_E_INVALID, std::string("pymem: ") + what + ": " + format_address(addr) +
                                          " is not a live pymem block of device " + std::to_string(device));
  if (arena_only && it->second.provider)
    return fail(PYMEM_CUDA_E_STATE, std::string("pymem: ") + what + ": " + format_address(addr) +
                                        " came from a block provider, which keeps its own owners");
  body(*d->arena, addr, it->second);
  return 0;
}

// Records a block just allocated on `stream` as live. A block for another stream than the primary
// one makes that stream wait for the primary's work first (see cuda_lib.h); if that fails, the
// block goes back to its source and the error is returned.
int track_block_locked(State& s, Device& d, uintptr_t addr, size_t nbytes, void* stream,
                       const pymem_block_provider* provider) {
  if (stream != d.primary) {
    if (int err = order_after_primary_locked(s, d, stream)) {
      release_block_locked(d, provider, addr);
      return fail(PYMEM_CUDA_E_CUDA, "pymem: making stream " + format_address(reinterpret_cast<uintptr_t>(stream)) +
                                         " wait for the primary stream failed with CUDA error " +
                                         std::to_string(err));
    }
  }
  BlockInfo info;
  info.provider = provider;
  info.size = pymem::align_up(nbytes);
  info.alloc_stream = stream;
  d.live.emplace(addr, std::move(info));
  return 0;
}

// pymem_cuda_alloc's provider path. Not noexcept: the provider's exception is the caller's.
uintptr_t alloc_from_provider(const pymem_block_provider* provider, size_t nbytes, int device, void* stream) {
  State& s = state();
  uintptr_t addr = 0;
  try {
    addr = provider->allocate(provider->ctx, nbytes, device);
  } catch (...) {
    // Blocks waiting for their streams hold the provider's bytes: give them back and retry once.
    size_t synced = 0;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (Device* d = find_device_locked(s, device)) synced = sync_pending_locked(s, *d);
    }
    if (synced == 0) throw;
    addr = provider->allocate(provider->ctx, nbytes, device);
  }
  uintptr_t result = 0;
  guarded("pymem_cuda_alloc", [&] {
    if (!addr)
      return fail(PYMEM_CUDA_E_INTERNAL, "pymem: the block provider of device " + std::to_string(device) +
                                             " returned no block for " + std::to_string(nbytes) + " bytes");
    std::lock_guard<std::mutex> lock(s.mu);
    if (int err = track_block_locked(s, get_device_locked(s, device), addr, nbytes, stream, provider)) return err;
    result = addr;
    return 0;
  });
  return result;
}

uintptr_t passthrough_allocate(void*, size_t nbytes, int device) {
  const pymem_cuda_table* t = state().active;
  void* p = nullptr;
  const int err = t ? t->malloc(&p, nbytes) : -1;
  if (err != 0 || !p)
    throw std::runtime_error("pymem (unmanaged, after pymem.disable()): cudaMalloc of " + std::to_string(nbytes) +
                             " bytes on device " + std::to_string(device) + " failed with CUDA error " +
                             std::to_string(err));
  return reinterpret_cast<uintptr_t>(p);
}

void passthrough_free(void*, uintptr_t addr, int) {
  if (const pymem_cuda_table* t = state().active) t->free(reinterpret_cast<void*>(addr));
}

const pymem_block_provider kPassthrough = {&passthrough_allocate, &passthrough_free, nullptr};

}  // namespace

extern "C" {

PYMEM_CUDA_API int pymem_cuda_abi_version(void) { return PYMEM_CUDA_ABI_VERSION; }

PYMEM_CUDA_API int pymem_cuda_relocate(void* from, void* to, int device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  Device* d = find_device_locked(s, device);
  const uintptr_t old_addr = reinterpret_cast<uintptr_t>(from), new_addr = reinterpret_cast<uintptr_t>(to);
  auto it = d ? d->live.find(old_addr) : std::unordered_map<uintptr_t, BlockInfo>::iterator();
  if (!d || it == d->live.end())
    return fail(PYMEM_CUDA_E_INVALID, "pymem: relocate: " + format_address(old_addr) +
                                          " is not a live pymem block of device " + std::to_string(device));
  if (d->live.count(new_addr))
    return fail(PYMEM_CUDA_E_INVALID, "pymem: relocate: " + format_address(new_addr) + " is already live on device " +
                                          std::to_string(device));
  BlockInfo info = std::move(it->second);
  d->live.erase(it);
  d->live.emplace(new_addr, std::move(info));
  return 0;
}

PYMEM_CUDA_API int pymem_cuda_configure(size_t budget, size_t small_threshold, int search_mode) {
  return guarded("pymem_cuda_configure", [&] {
    if (search_mode != PYMEM_CUDA_SEARCH_WINDOW && search_mode != PYMEM_CUDA_SEARCH_ONE_AT_A_TIME)
      return fail(PYMEM_CUDA_E_INVALID, "pymem: search_mode must be 0 (window) or 1 (one at a time), got " +
                                            std::to_string(search_mode));
    pymem::ArenaConfig cfg;
    cfg.budget = budget;
    cfg.small_threshold = small_threshold;
    cfg.mode = static_cast<pymem::SearchMode>(search_mode);
    pymem::check_budget(budget);  // the arena's own validation: throws InvalidArgument
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (any_arena_locked(s))
      return fail(PYMEM_CUDA_E_STATE,
                  "pymem: already initialised: pymem_cuda_configure must be called before the first "
                  "CUDA allocation (call pymem_cuda_reset first to start over)");
    s.config = cfg;
    s.configured = true;
    return 0;
  });
}

PYMEM_CUDA_API int pymem_cuda_set_table(const pymem_cuda_table* table) {
  return guarded("pymem_cuda_set_table", [&] {
    if (table) {
      const void* entries[] = {
          reinterpret_cast<const void*>(table->malloc), reinterpret_cast<const void*>(table->free),
          reinterpret_cast<const void*>(table->get_device), reinterpret_cast<const void*>(table->set_device),
          reinterpret_cast<const void*>(table->event_create), reinterpret_cast<const void*>(table->event_destroy),
          reinterpret_cast<const void*>(table->event_record), reinterpret_cast<const void*>(table->event_query),
          reinterpret_cast<const void*>(table->event_synchronize),
          reinterpret_cast<const void*>(table->stream_wait_event)};
      for (const void* e : entries)
        if (!e) return fail(PYMEM_CUDA_E_INVALID, "pymem: every entry of the CUDA table must be set");
    }
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    bool blocks = false;
    for (const auto& kv : s.devices) blocks |= !kv.second->live.empty() || !kv.second->pending.empty();
    if (any_arena_locked(s) || blocks)
      return fail(PYMEM_CUDA_E_STATE,
                  "pymem: the CUDA table can only be changed while no arena exists and no block is "
                  "allocated (call pymem_cuda_reset first)");
    s.custom_table = table ? new pymem_cuda_table(*table) : nullptr;
    s.active = nullptr;  // resolved again with the next arena
    return 0;
  });
}

PYMEM_CUDA_API void* pymem_cuda_alloc(ssize_t size, int device, void* stream) {
  uintptr_t result = 0;
  const pymem_block_provider* provider = nullptr;
  // Validation, and the arena path whole; a provider is called below, outside this noexcept guard,
  // so its exception reaches our caller.
  guarded("pymem_cuda_alloc", [&] {
    if (size == 0) return 0;
    if (size < 0)
      return fail(PYMEM_CUDA_E_INVALID, "pymem: allocation size must be >= 0, got " + std::to_string(size));
    if (device < 0)
      return fail(PYMEM_CUDA_E_INVALID, "pymem: device must be >= 0, got " + std::to_string(device));
    State& s = state();
    std::shared_ptr<Arena> arena;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      Device& d = get_device_locked(s, device);
      if (d.provider) {
        if (int err = ensure_table_locked(s)) return err;  // events order its frees
        provider = d.provider;
      } else if (int err = ensure_arena_locked(s, d)) {
        return err;
      }
      if (!d.has_primary) {
        d.has_primary = true;
        d.primary = stream;
      }
      poll_pending_locked(s, d);
      if (provider) return 0;
      arena = d.arena;
    }
    const size_t nbytes = static_cast<size_t>(size);
    uintptr_t addr = 0;
    for (;;) {
      try {
        addr = arena->allocate(nbytes);  // may run the pressure handler: no library lock held
        break;
      } catch (const pymem::OutOfBudget& e) {
        std::lock_guard<std::mutex> lock(s.mu);
        Device* d = find_device_locked(s, device);
        // Blocks waiting for their streams first; retry as long as that frees something.
        if (d && d->arena == arena && sync_pending_locked(s, *d) > 0) continue;
        if (d) ++d->ooms;
        return fail(PYMEM_CUDA_E_OOM, std::string(e.what()) + " (device " + std::to_string(device) + ")");
      }
    }
    std::lock_guard<std::mutex> lock(s.mu);
    Device* d = find_device_locked(s, device);
    if (!d || d->arena != arena) {  // pymem_cuda_reset raced with us (it must not)
      arena->try_free(addr);
      return fail(PYMEM_CUDA_E_STATE, "pymem: pymem_cuda_reset ran during an allocation");
    }
    if (int err = track_block_locked(s, *d, addr, nbytes, stream, nullptr)) return err;
    result = addr;
    return 0;
  });
  if (provider) result = alloc_from_provider(provider, static_cast<size_t>(size), device, stream);
  return reinterpret_cast<void*>(result);
}

// `size` and `stream` are what PyTorch remembered from the allocation; the library keeps both itself.
PYMEM_CUDA_API void pymem_cuda_free(void* ptr, ssize_t size, int device, void* stream) {
  guarded("pymem_cuda_free", [&] { return free_impl(ptr, device); });
}

PYMEM_CUDA_API int pymem_cuda_free_checked(void* ptr, int device) {
  return guarded("pymem_cuda_free", [&] { return free_impl(ptr, device); });
}

PYMEM_CUDA_API int pymem_cuda_free_owned(void* ptr, int device, uint64_t owner) {
  return guarded("pymem_cuda_free_owned", [&] { return free_impl(ptr, device, &owner); });
}

PYMEM_CUDA_API int pymem_cuda_record_stream(void* ptr, int device, void* stream) {
  return guarded("pymem_cuda_record_stream", [&] {
    return with_live_block("record_stream", ptr, device, false, [&](Arena&, uintptr_t, BlockInfo& b) {
      if (stream != b.alloc_stream &&
          std::find(b.other_streams.begin(), b.other_streams.end(), stream) == b.other_streams.end())
        b.other_streams.push_back(stream);
    });
  });
}

PYMEM_CUDA_API int pymem_cuda_set_primary_stream(int device, void* stream) {
  return guarded("pymem_cuda_set_primary_stream", [&] {
    if (device < 0)
      return fail(PYMEM_CUDA_E_INVALID, "pymem: device must be >= 0, got " + std::to_string(device));
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    Device& d = get_device_locked(s, device);
    if (d.has_primary && d.primary != stream && d.arena) {
      // Blocks freed straight back may still be used by the old primary's queued work.
      if (int err = order_after_primary_locked(s, d, stream))
        return fail(PYMEM_CUDA_E_CUDA, "pymem: ordering the new primary stream after the old one failed "
                                       "with CUDA error " + std::to_string(err));
    }
    d.has_primary = true;
    d.primary = stream;
    return 0;
  });
}

PYMEM_CUDA_API void pymem_cuda_set_pressure_handler(pymem_pressure_fn fn, void* ctx) {
  guarded("pymem_cuda_set_pressure_handler", [&] {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    s.pressure_fn = fn;
    s.pressure_ctx = ctx;
    for (auto& kv : s.devices)
      if (kv.second->arena) install_handler(*kv.second->arena, kv.first, fn != nullptr);
    return 0;
  });
}

PYMEM_CUDA_API int pymem_cuda_set_owner(void* ptr, int device, uint64_t owner, double cost) {
  return guarded("pymem_cuda_set_owner", [&] {
    return with_live_block("set_owner", ptr, device, true,
                           [&](Arena& a, uintptr_t addr, BlockInfo& b) {
                             a.set_owner(addr, owner, cost);  // throws before any change on a bad cost
                             b.owner = owner;
                           });
  });
}

PYMEM_CUDA_API int pymem_cuda_set_pinned(void* ptr, int device, int pinned) {
  return guarded("pymem_cuda_set_pinned", [&] {
    return with_live_block("set_pinned", ptr, device, true,
                           [&](Arena& a, uintptr_t addr, BlockInfo&) { a.set_pinned(addr, pinned != 0); });
  });
}

PYMEM_CUDA_API int pymem_cuda_set_provider(int device, const pymem_block_provider* provider) {
  return guarded("pymem_cuda_set_provider", [&] {
    if (device < 0)
      return fail(PYMEM_CUDA_E_INVALID, "pymem: device must be >= 0, got " + std::to_string(device));
    if (provider && (!provider->allocate || !provider->free))
      return fail(PYMEM_CUDA_E_INVALID, "pymem: a block provider needs both allocate and free");
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    Device& d = get_device_locked(s, device);
    if (!d.pending.empty()) sync_pending_locked(s, d);
    if (!provider) {
      d.provider = nullptr;
      return 0;
    }
    s.providers.push_back(std::make_unique<pymem_block_provider>(*provider));
    d.provider = s.providers.back().get();
    return 0;
  });
}

PYMEM_CUDA_API const pymem_block_provider* pymem_cuda_passthrough_provider(void) { return &kPassthrough; }

PYMEM_CUDA_API const pymem_cuda_table* pymem_cuda_runtime_table(void) {
  const pymem_cuda_table* t = nullptr;
  guarded("pymem_cuda_runtime_table", [&] {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (int err = ensure_table_locked(s)) return err;
    t = s.active;
    return 0;
  });
  return t;
}

PYMEM_CUDA_API int pymem_cuda_get_stats(int device, pymem_cuda_stats* out) {
  return guarded("pymem_cuda_get_stats", [&] {
    if (!out) return fail(PYMEM_CUDA_E_INVALID, "pymem: get_stats: null output");
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    Device* d = find_device_locked(s, device);
    if (!d || !d->arena)
      return fail(PYMEM_CUDA_E_STATE, "pymem: device " + std::to_string(device) +
                                          " has no arena (nothing was allocated on it yet)");
    const pymem::ArenaStats a = d->arena->stats();
    pymem_cuda_stats r{};
    r.budget = a.budget;
    r.allocated_bytes = a.allocated_bytes;
    r.peak_allocated_bytes = a.peak_allocated_bytes;
    r.num_allocs = a.num_allocs;
    r.num_frees = a.num_frees;
    r.num_pressure_events = a.num_pressure_events;
    r.num_released_blocks = a.num_released_blocks;
    r.num_ooms = d->ooms;
    r.largest_free_block = a.largest_free_block;
    r.num_blocks = a.num_blocks;
    r.pending_frees = d->pending.size();
    r.pending_bytes = d->pending_bytes;
    r.bad_frees = d->bad_frees;
    *out = r;
    return 0;
  });
}

PYMEM_CUDA_API int pymem_cuda_reset(void) {
  return guarded("pymem_cuda_reset", [&] {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    for (const auto& kv : s.devices) {
      const Device& d = *kv.second;
      if (!d.live.empty()) {
        size_t bytes = 0;
        for (const auto& b : d.live) bytes += b.second.size;
        return fail(PYMEM_CUDA_E_STATE, "pymem: cannot reset: " + std::to_string(d.live.size()) +
                                            " blocks (" + std::to_string(bytes) +
                                            " bytes) are still allocated on device " +
                                            std::to_string(kv.first));
      }
    }
    for (auto& kv : s.devices) {
      Device& d = *kv.second;
      if (!s.active) continue;  // never used the runtime: no events, no slab
      sync_pending_locked(s, d);  // a provider's blocks too, back to it
      destroy_events_locked(s, d);
      d.arena.reset();  // cudaFree of the slab, if any
    }
    s.devices.clear();
    s.active = nullptr;
    return 0;
  });
}

PYMEM_CUDA_API const char* pymem_cuda_last_error(void) { return t_last_error.c_str(); }
PYMEM_CUDA_API int pymem_cuda_last_error_code(void) { return t_last_code; }

}  // extern "C"
