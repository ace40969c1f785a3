// hook_pluggable.h — the runtime's arena behind libpymem_cuda.so (a block provider), and a CPU
// allocator that calls a CUDAPluggableAllocator-style alloc/free pair.
//
// On CUDA, PyTorch reaches libpymem_cuda.so through CUDAPluggableAllocator; the library takes its
// blocks from the provider made here, i.e. from an Arena of pymem._C, whose pressure handler runs
// the runtime's policy and whose refusals are thrown through the library as ArenaRefusal, c10's
// OutOfMemoryError (allocator_install.h), which pymem turns into pymem.OutOfBudgetError. The
// pluggable CPU allocator sends CPU tensors down that same path, with the library on a fake CUDA
// table over host memory: how the whole route runs in tests without a GPU.
#pragma once

#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <memory>

#include "arena.h"

namespace pymem {

// The address of a pymem_block_provider (cuda_lib.h) serving blocks from `arena`. The arena is kept
// alive for the life of the process: blocks it served may be freed at any time, from any thread.
uintptr_t arena_block_provider(std::shared_ptr<Arena> arena);

// Routes every later CPU allocation to alloc_fn(size, 0, nullptr) and its free to
// free_fn(ptr, size, 0, nullptr): the signatures of CUDAPluggableAllocator's entry points.
// Throws InvalidArgument while another hook is installed (allocator_install.h).
void install_pluggable_cpu_hook(uintptr_t alloc_fn, uintptr_t free_fn);
// Gives PyTorch back the allocator it had; tensors made meanwhile are still freed through free_fn.
void uninstall_pluggable_cpu_hook();

// Compaction across the library: relocate_fn is pymem_cuda_relocate (the library learns the block's
// new address), free_fn pymem_cuda_free (the deleter of a moved block calls it with the new one).
void set_pluggable_relocation(uintptr_t relocate_fn, uintptr_t free_fn);
// Repoints storage `s`, whose library block compaction moved to `to`: the library's record first,
// then the DataPtr. False if `s` did not come through the library (or no relocation is set). A
// moved CUDA block gets a deleter of ours: PyTorch's pluggable deleter frees by the address it
// handed out (its metadata entry for the old address goes stale, and is overwritten when the
// library hands that address out again).
bool relocate_pluggable(c10::StorageImpl* s, uintptr_t to);

// alloc_fn(nbytes, device, stream) called from C++, for Python callers (CuPy's allocator,
// pymem/cupy.py): a block provider's refusal is thrown through the library, which ctypes cannot
// carry, and arrives here as pymem.OutOfBudgetError. Returns 0 when the library refuses by itself.
uintptr_t call_pluggable_alloc(uintptr_t alloc_fn, size_t nbytes, int device, uintptr_t stream);

}  // namespace pymem
