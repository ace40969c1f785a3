// hook_pluggable.h — the runtime's arena behind libpymem_cuda.so (a block provider), and a CPU
// allocator that calls a CUDAPluggableAllocator-style alloc/free pair.
//
// On CUDA, PyTorch reaches libpymem_cuda.so through CUDAPluggableAllocator; the library takes its
// blocks from the provider made here, i.e. from an Arena of pymem._C, whose pressure handler runs
// the runtime's policy and whose refusals become pymem.OutOfBudgetError (thrown through the library
// into PyTorch's op wrapper). The pluggable CPU allocator sends CPU tensors down that same path, with
// the library on a fake CUDA table over host memory: how the whole route runs in tests without a GPU.
#pragma once

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

// alloc_fn(nbytes, device, stream) called from C++, for Python callers (CuPy's allocator,
// pymem/cupy.py): a block provider's refusal is thrown through the library, which ctypes cannot
// carry, and arrives here as pymem.OutOfBudgetError. Returns 0 when the library refuses by itself.
uintptr_t call_pluggable_alloc(uintptr_t alloc_fn, size_t nbytes, int device, uintptr_t stream);

}  // namespace pymem
