/* cuda_lib.h — the C ABI of libpymem_cuda.so.
 *
 * libpymem_cuda.so serves every CUDA allocation of a process from one pymem::Arena per device: a
 * single cudaMalloc slab of exactly the budget, cut into blocks. It is a plain C library (no
 * libtorch, no link-time libcudart: the runtime is reached through the table of cuda_table.h), so
 * PyTorch can load it with
 *
 *   torch.cuda.memory.CUDAPluggableAllocator(path, "pymem_cuda_alloc", "pymem_cuda_free")
 *
 * and Python drives the rest through ctypes (pymem/cuda_lib.py).
 *
 * Errors: every int-returning function returns PYMEM_CUDA_OK (0) or one of the PYMEM_CUDA_E_*
 * codes; pymem_cuda_alloc returns NULL. The message and code of this thread's most recent failure
 * are kept (thread-local) until the next failure: pymem_cuda_last_error / _last_error_code.
 * Nothing of this library's throws across this boundary and no bad input crashes the process; the
 * one exception is a block provider's (below), which pymem_cuda_alloc lets through on purpose.
 *
 * Block providers. By default a device's blocks come from the library's own arena (configured with
 * pymem_cuda_configure). pymem's runtime instead sets a provider per device: its own arena
 * (pymem._C, where the pressure handler can run the eviction policy and a refusal can become a
 * Python pymem.OutOfBudgetError), or the pass-through provider (plain cudaMalloc / cudaFree: what
 * the process keeps after pymem.disable(), because PyTorch cannot swap its allocator back). The
 * library still orders every block's free by stream.
 *
 * Stream order. The primary stream of a device is the stream of its first allocation (or the one
 * set with pymem_cuda_set_primary_stream). A block allocated on the primary stream and never
 * recorded on another stream goes straight back to the arena when freed: all later work on that
 * stream is ordered after its last use. Any other block gets one event per stream that used it and
 * waits on a pending list until they all complete. An allocation on a non-primary stream makes that
 * stream wait for the primary stream's work so far, because a block freed straight back may still
 * be read by kernels queued on the primary stream.
 *
 * Threads: all entry points are thread-safe except pymem_cuda_reset, pymem_cuda_set_table and
 * pymem_cuda_configure, which must not race with allocations (they are set-up / test calls). */
#ifndef PYMEM_CUDA_LIB_H
#define PYMEM_CUDA_LIB_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t: the size type of CUDAPluggableAllocator's entry points */

#include "cuda_table.h"

#if defined(__GNUC__)
#define PYMEM_CUDA_API __attribute__((visibility("default")))
#else
#define PYMEM_CUDA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a declaration below changes; the ctypes wrapper refuses a library it does not
 * know. 2: block providers. */
#define PYMEM_CUDA_ABI_VERSION 4

enum {
  PYMEM_CUDA_OK = 0,
  PYMEM_CUDA_E_INVALID = 1,  /* bad argument: budget, size, unknown pointer, null table entry */
  PYMEM_CUDA_E_STATE = 2,    /* wrong time: configure after an arena exists, no arena yet, ... */
  PYMEM_CUDA_E_OOM = 3,      /* the request does not fit the budget, even after releasing */
  PYMEM_CUDA_E_CUDA = 4,     /* the CUDA runtime failed (or could not be loaded) */
  PYMEM_CUDA_E_INTERNAL = 5  /* anything else (std::bad_alloc, a broken invariant) */
};

/* Search modes of pymem_cuda_configure (pymem::SearchMode). */
enum { PYMEM_CUDA_SEARCH_WINDOW = 0, PYMEM_CUDA_SEARCH_ONE_AT_A_TIME = 1 };

/* A block the pressure handler is asked to release (pymem::Victim). */
typedef struct pymem_victim {
  uint64_t owner;
  uint64_t addr;
  uint64_t size;
  double cost;
} pymem_victim;

/* Counters of one device. Byte counts are rounded to 512. Blocks whose free is pending still count
 * as allocated (the arena cannot hand them out yet). num_ooms counts allocations that returned
 * NULL for lack of room; bad_frees counts frees of pointers this device did not hand out. */
typedef struct pymem_cuda_stats {
  uint64_t budget;
  uint64_t allocated_bytes;
  uint64_t peak_allocated_bytes;
  uint64_t num_allocs;
  uint64_t num_frees;
  uint64_t num_pressure_events;
  uint64_t num_released_blocks;
  uint64_t num_ooms;
  uint64_t largest_free_block;
  uint64_t num_blocks;
  uint64_t pending_frees;
  uint64_t pending_bytes;
  uint64_t bad_frees;
} pymem_cuda_stats;

/* Called, with no pymem lock held, when an allocation of `request` (rounded) bytes does not fit and
 * no pending free is left to wait for. `victims` (valid only during the call) is the window the
 * arena chose; the handler releases what it can by calling pymem_cuda_free_owned (or
 * pymem_cuda_free) on those blocks, and the arena retries. If it frees nothing, the allocation
 * fails. Victims freed here that other streams used are waited for before the retry. */
typedef void (*pymem_pressure_fn)(int device, size_t request, const pymem_victim* victims,
                                  size_t n_victims, void* ctx);

PYMEM_CUDA_API int pymem_cuda_abi_version(void);

/* Budget (bytes, per device), small-request threshold (0 disables the small region) and search
 * mode for arenas created from now on. Only while no arena exists. */
PYMEM_CUDA_API int pymem_cuda_configure(size_t budget, size_t small_threshold, int search_mode);

/* Use `table` (copied) instead of the real CUDA runtime; NULL goes back to the real runtime, loaded
 * on the first allocation. Only while no arena exists (arenas keep using the table they got). */
PYMEM_CUDA_API int pymem_cuda_set_table(const pymem_cuda_table* table);

/* CUDAPluggableAllocator entry points. alloc returns NULL for size 0 and on any failure. free
 * ignores `size` and `stream` (PyTorch passes back those of the allocation): the streams a block
 * waits for are its allocation stream and those given to pymem_cuda_record_stream, as in PyTorch's
 * caching allocator. Freeing NULL does nothing; freeing anything else unknown is counted
 * (bad_frees) and reported through pymem_cuda_last_error. */
PYMEM_CUDA_API void* pymem_cuda_alloc(ssize_t size, int device, void* stream);
PYMEM_CUDA_API void pymem_cuda_free(void* ptr, ssize_t size, int device, void* stream);
/* pymem_cuda_free with a result, for callers that can act on one (Python). */
PYMEM_CUDA_API int pymem_cuda_free_checked(void* ptr, int device);
/* Frees ptr only if it is a live block whose owner (pymem_cuda_set_owner) is `owner`; otherwise
 * returns PYMEM_CUDA_E_INVALID and frees nothing (not counted as a bad free). Pressure handlers
 * should release victims with it: with several allocating threads, a victim may already have been
 * released by another handler, and its address handed out again, by the time this one runs. */
PYMEM_CUDA_API int pymem_cuda_free_owned(void* ptr, int device, uint64_t owner);

/* Compaction moved the live block at `from` (its bytes and its arena block) to `to`: it is known by
 * `to` from now on (its streams and owner unchanged). PYMEM_CUDA_E_INVALID if `from` is not live. */
PYMEM_CUDA_API int pymem_cuda_relocate(void* from, void* to, int device);

/* The block at ptr is also used on `stream`: its free waits for that stream's work. */
PYMEM_CUDA_API int pymem_cuda_record_stream(void* ptr, int device, void* stream);
/* Make `stream` the primary stream of `device` (before or after its first allocation). */
PYMEM_CUDA_API int pymem_cuda_set_primary_stream(int device, void* stream);

/* Pressure protocol: the handler (NULL: none) and per-block owner / release cost / pinning.
 * owner 0 means "not releasable". */
PYMEM_CUDA_API void pymem_cuda_set_pressure_handler(pymem_pressure_fn fn, void* ctx);
PYMEM_CUDA_API int pymem_cuda_set_owner(void* ptr, int device, uint64_t owner, double cost);
PYMEM_CUDA_API int pymem_cuda_set_pinned(void* ptr, int device, int pinned);

PYMEM_CUDA_API int pymem_cuda_get_stats(int device, pymem_cuda_stats* out);

/* A source of blocks owned by someone else. allocate returns the address of a block of at least
 * nbytes (> 0) bytes on `device`, and reports failure by throwing a C++ exception:
 * pymem_cuda_alloc lets it reach its caller (PyTorch's CUDAPluggableAllocator, whose op wrappers
 * turn it into a Python exception), after one retry once this library's pending frees are
 * synchronised. So with a provider set, call pymem_cuda_alloc from C++, never through ctypes.
 * allocate runs without the library's lock (it may free blocks through this library); free runs
 * under it, must not throw and must not call back into this library. */
typedef struct pymem_block_provider {
  uintptr_t (*allocate)(void* ctx, size_t nbytes, int device);
  void (*free)(void* ctx, uintptr_t addr, int device);
  void* ctx;
} pymem_block_provider;

/* Serve `device` from `provider` (copied; NULL: back to the library's own arena). Blocks keep the
 * provider that made them: their frees go back to it, whatever is set later. Pending frees of the
 * device are synchronised first, so the old source gets its blocks back. */
PYMEM_CUDA_API int pymem_cuda_set_provider(int device, const pymem_block_provider* provider);
/* The built-in provider that passes every request to cudaMalloc / cudaFree (of the table in use);
 * it throws std::runtime_error, naming the size and the CUDA error, when cudaMalloc fails. */
PYMEM_CUDA_API const pymem_block_provider* pymem_cuda_passthrough_provider(void);
/* The CUDA runtime table the library uses: the one given to pymem_cuda_set_table, or libcudart
 * loaded now. Valid for the life of the process (a later pymem_cuda_set_table does not change
 * it). NULL, with an error, when no libcudart can be loaded. */
PYMEM_CUDA_API const pymem_cuda_table* pymem_cuda_runtime_table(void);

/* Drop every arena, pending list and event (tests). Fails if a block is still allocated; pending
 * frees are synchronised first. Configuration, table and pressure handler are kept. */
PYMEM_CUDA_API int pymem_cuda_reset(void);

PYMEM_CUDA_API const char* pymem_cuda_last_error(void);
PYMEM_CUDA_API int pymem_cuda_last_error_code(void);

#ifdef __cplusplus
} /* extern "C" */

#include <string>

namespace pymem {
// The real CUDA runtime: dlopen of libcudart (the one PyTorch already loaded when there is one).
// Loaded once; returns null and sets *error when no libcudart can be found.
const pymem_cuda_table* load_cuda_runtime(std::string* error);
}  // namespace pymem
#endif

#endif /* PYMEM_CUDA_LIB_H */
