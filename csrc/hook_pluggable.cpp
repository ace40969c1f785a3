// hook_pluggable.cpp — see hook_pluggable.h.
#include "hook_pluggable.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <sys/types.h>
#include <vector>

#include "allocator_install.h"
#include "cuda_lib.h"

namespace pymem {

namespace {

// ---- the arena as a block provider -----------------------------------------------------------

uintptr_t provider_allocate(void* ctx, size_t nbytes, int) {
  try {
    return static_cast<Arena*>(ctx)->allocate(nbytes, thread_allocation_class());
  } catch (const OutOfBudget& e) {
    raise_arena_refusal(e);  // c10's type, through the library to PyTorch (see ArenaRefusal)
  }
}

// A deleter's free: it cannot throw, so a bad address is reported, not raised.
void provider_free(void* ctx, uintptr_t addr, int) {
  if (!static_cast<Arena*>(ctx)->try_free(addr)) {
    std::fprintf(stderr, "pymem: the CUDA library freed %p, which its arena did not allocate; ignored\n",
                 reinterpret_cast<void*>(addr));
  }
}

// Never released, not even at exit (see header): heap objects whose destructors never run. A static
// vector's destructor would free the slabs at exit, through a CUDA table that may call into a
// finalised interpreter (tests' fakes) or a CUDA runtime already torn down (a GPU).
std::mutex g_providers_mutex;
auto* const g_provider_arenas = new std::vector<std::shared_ptr<Arena>>;
auto* const g_providers = new std::vector<std::unique_ptr<pymem_block_provider>>;

// ---- the pluggable CPU allocator ---------------------------------------------------------------

using AllocFn = void* (*)(ssize_t, int, void*);
using FreeFn = void (*)(void*, ssize_t, int, void*);

std::atomic<AllocFn> g_alloc{nullptr};
// The last free function installed: tensors outlive the install, and all go back through it.
std::atomic<FreeFn> g_free{nullptr};

void pluggable_delete(void* ptr) {
  if (ptr) g_free.load(std::memory_order_acquire)(ptr, 0, 0, nullptr);
}

class PluggableCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (nbytes == 0) return {nullptr, nullptr, &pluggable_delete, cpu};
    AllocFn alloc = g_alloc.load(std::memory_order_acquire);
    TORCH_CHECK(alloc, "pymem: the pluggable CPU hook is installed without an alloc function");
    void* p = alloc(static_cast<ssize_t>(nbytes), 0, nullptr);  // may throw (a provider's refusal)
    TORCH_CHECK_WITH(OutOfMemoryError, p, "pymem: the pluggable allocator returned no memory for ", nbytes,
                     " bytes");
    return {p, p, &pluggable_delete, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pluggable_delete; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PluggableCPUAllocator g_allocator;

// ---- relocation (compaction of the library's arena) ------------------------------------------

using RelocateFn = int (*)(void*, void*, int);
std::atomic<RelocateFn> g_relocate{nullptr};
std::atomic<FreeFn> g_moved_free{nullptr};

// A moved CUDA block: its current address and device, for the library's free.
struct MovedBlock {
  void* ptr;
  int device;
};

void moved_delete(void* ctx) {
  auto* m = static_cast<MovedBlock*>(ctx);
  g_moved_free.load(std::memory_order_acquire)(m->ptr, 0, m->device, nullptr);
  delete m;
}

}  // namespace

void set_pluggable_relocation(uintptr_t relocate_fn, uintptr_t free_fn) {
  if (!relocate_fn || !free_fn) throw InvalidArgument("set_pluggable_relocation needs relocate and free functions");
  g_moved_free.store(reinterpret_cast<FreeFn>(free_fn), std::memory_order_release);
  g_relocate.store(reinterpret_cast<RelocateFn>(relocate_fn), std::memory_order_release);
}

bool relocate_pluggable(c10::StorageImpl* s, uintptr_t to) {
  RelocateFn relocate = g_relocate.load(std::memory_order_acquire);
  const c10::DataPtr& old = s->data_ptr();
  const c10::Device dev = old.device();
  const bool cpu_route = old.get_deleter() == &pluggable_delete;
  const bool moved = old.get_deleter() == &moved_delete;
  if (!relocate || !(cpu_route || moved || dev.is_cuda())) return false;
  const int device = dev.is_cuda() ? dev.index() : 0;
  void* p = reinterpret_cast<void*>(to);
  const int rc = relocate(old.get(), p, device);
  TORCH_CHECK(rc == 0, "pymem: the CUDA library refused to relocate ", old.get(), " (error ", rc, ")");
  c10::DataPtr next;
  if (cpu_route) {
    next = c10::DataPtr(p, p, &pluggable_delete, dev);
  } else if (moved) {
    auto* m = static_cast<MovedBlock*>(old.get_context());
    m->ptr = p;
    next = c10::DataPtr(p, m, &moved_delete, dev);
  } else {
    next = c10::DataPtr(p, new MovedBlock{p, device}, &moved_delete, dev);
  }
  c10::DataPtr prev = s->set_data_ptr(std::move(next));
  (void)prev.release_context();  // the block lives on at `to`: nothing of the old one is freed
  return true;
}

uintptr_t arena_block_provider(std::shared_ptr<Arena> arena) {
  if (!arena) throw InvalidArgument("arena_block_provider needs an arena");
  std::lock_guard<std::mutex> lock(g_providers_mutex);
  g_provider_arenas->push_back(arena);
  g_providers->push_back(std::make_unique<pymem_block_provider>(
      pymem_block_provider{&provider_allocate, &provider_free, arena.get()}));
  return reinterpret_cast<uintptr_t>(g_providers->back().get());
}

void install_pluggable_cpu_hook(uintptr_t alloc_fn, uintptr_t free_fn) {
  if (!alloc_fn || !free_fn) throw InvalidArgument("install_pluggable_cpu_hook needs alloc and free functions");
  install_cpu_allocator(CpuHookKind::Pluggable, &g_allocator, [&](bool, c10::Allocator*) {
    g_free.store(reinterpret_cast<FreeFn>(free_fn), std::memory_order_release);
    g_alloc.store(reinterpret_cast<AllocFn>(alloc_fn), std::memory_order_release);
  });
}

void uninstall_pluggable_cpu_hook() {
  uninstall_cpu_allocator(CpuHookKind::Pluggable, [] { g_alloc.store(nullptr, std::memory_order_release); });
}

uintptr_t call_pluggable_alloc(uintptr_t alloc_fn, size_t nbytes, int device, uintptr_t stream) {
  if (!alloc_fn) throw InvalidArgument("call_pluggable_alloc needs an alloc function");
  void* p = reinterpret_cast<AllocFn>(alloc_fn)(static_cast<ssize_t>(nbytes), device, reinterpret_cast<void*>(stream));
  return reinterpret_cast<uintptr_t>(p);
}

}  // namespace pymem
