// hook_cpu.cpp — a c10::Allocator over an Arena.
//
// DataPtr context == data pointer (so c10's raw_allocate/raw_deallocate work); the deleter finds
// the owning arena by address. Every arena ever installed is kept alive for the life of the
// process in `g_arenas`: a tensor made under it may die at any time, from any thread, and its
// deleter must find a live arena. Lookups are lock-free over a fixed array of slots.
#include "hook_cpu.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <vector>

#include "allocator_install.h"

namespace pymem {

namespace {

// Each pymem.enable() installs a new arena, and arenas are never destroyed (see above), so this
// bounds enable/disable cycles per process. The deleter tries the active arena first, so the scan
// over older ones costs only frees of tensors that outlived their runtime.
constexpr size_t kMaxArenas = 4096;

std::array<std::atomic<Arena*>, kMaxArenas> g_slots{};
std::atomic<size_t> g_num_slots{0};
std::atomic<Arena*> g_active{nullptr};
std::atomic<uint64_t> g_bad_frees{0};
// Guards the two below. Written only under the install lock too (allocator_install.h), which
// orders installs; this one lets cpu_hook_arena read without it.
std::mutex g_owner_mutex;
// Keeps every installed arena alive, even through exit (never destroyed): a tensor freed by another
// library's static destructor must still find its arena.
auto* const g_arenas = new std::vector<std::shared_ptr<Arena>>;
std::shared_ptr<Arena> g_active_owner;

void delete_fn(void* ptr) {
  if (!ptr) return;  // c10 may hand back the null DataPtr of a 0-byte allocation
  const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
  // Fast path: most frees go to the arena installed now. Then the others, newest first.
  Arena* active = g_active.load(std::memory_order_acquire);
  if (active && active->contains(a)) {
    if (active->try_free(a)) return;
  } else {
    for (size_t i = g_num_slots.load(std::memory_order_acquire); i-- > 0;) {
      Arena* arena = g_slots[i].load(std::memory_order_acquire);
      if (arena->contains(a)) {
        if (arena->try_free(a)) return;
        break;
      }
    }
  }
  g_bad_frees.fetch_add(1);
  std::fprintf(stderr, "pymem: CPU hook asked to free %p, which no arena has allocated; ignored\n", ptr);
}

class ArenaCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (nbytes == 0) return {nullptr, nullptr, &delete_fn, cpu};
    Arena* arena = g_active.load(std::memory_order_acquire);
    TORCH_CHECK(arena, "pymem: the CPU hook is installed without an arena");
    uintptr_t a;
    try {
      a = arena->allocate(nbytes, thread_allocation_class());
    } catch (const OutOfBudget& e) {
      raise_out_of_budget_in_allocator(e);
    }
    void* p = reinterpret_cast<void*>(a);
    return {p, p, &delete_fn, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_fn; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

ArenaCPUAllocator g_allocator;

}  // namespace

bool is_cpu_hook_buffer(const void* data, const void* context, void (*deleter)(void*)) {
  return data != nullptr && data == context && deleter == &delete_fn;
}

void install_cpu_hook(std::shared_ptr<Arena> arena) {
  if (!arena) throw InvalidArgument("install_cpu_hook needs an arena");
  if (std::string(arena->backing_kind()) != "host")
    throw InvalidArgument(std::string("the CPU hook needs a 'host' arena (tensors must be able to touch "
                                      "their bytes), got a '") + arena->backing_kind() + "' arena");
  install_cpu_allocator(CpuHookKind::Arena, &g_allocator, [&](bool, c10::Allocator*) {
    std::lock_guard<std::mutex> lock(g_owner_mutex);
    bool known = false;
    for (const auto& a : *g_arenas) known |= (a == arena);
    if (!known) {
      const size_t n = g_num_slots.load();
      if (n == kMaxArenas)
        throw InvalidArgument("pymem: at most " + std::to_string(kMaxArenas) +
                              " distinct arenas can be installed as the CPU allocator in one process");
      g_arenas->push_back(arena);
      g_slots[n].store(arena.get(), std::memory_order_release);
      g_num_slots.store(n + 1, std::memory_order_release);
    }
    // Before the allocator is registered: its first allocate finds the arena.
    g_active.store(arena.get(), std::memory_order_release);
    g_active_owner = arena;
  });
}

void uninstall_cpu_hook() {
  uninstall_cpu_allocator(CpuHookKind::Arena, [] {
    std::lock_guard<std::mutex> lock(g_owner_mutex);
    g_active.store(nullptr, std::memory_order_release);
    g_active_owner.reset();
  });
}

std::shared_ptr<Arena> cpu_hook_arena() {
  std::lock_guard<std::mutex> lock(g_owner_mutex);
  return g_active_owner;
}

uint64_t cpu_hook_bad_frees() { return g_bad_frees.load(); }

}  // namespace pymem
