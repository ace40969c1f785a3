// host_pool.h — the host memory that offloaded values are copied to (issue 15's pinned host pool).
//
// Host copies live outside the device budget. Asking the system (cudaHostAlloc: pinned, slow,
// serialising the device) for each copy would put a pinned allocation on the hot path, and
// PyTorch's pinned cache rounds every request to a power of two and never gives back or reports.
// So the pool takes memory in large chunks and hands out blocks of them:
//   - a chunk is taken when no free block holds a request: max(chunk_bytes, the request), no more
//     than the cap leaves; chunks are given back only when the pool closes (no pinned allocation
//     after the first step, which takes what the steady state needs);
//   - best fit over free blocks (every chunk's), split on allocation, coalesced with free neighbours
//     of the same chunk on release, in kAlign units (no power-of-two rounding);
//   - reuse after completion: a copy enqueued on a stream reads or writes a block after the caller
//     moved on, so `record_use(p, stream)` records an event there; a block released with events
//     not yet complete waits (pending) and becomes free when they are (queried at each allocate);
//   - an optional cap on the chunks' bytes: allocate returns null when neither a free block, a
//     completed pending one nor a new chunk under the cap holds the request; the caller then
//     evicts instead of offloading, or raises (it knows the device's figures).
// The platform layer is HostChunkSource: malloc on the CPU device (events never needed: copies
// there complete before the caller moves on), cudaHostAlloc through the CUDA table on CUDA.
//
// Invariants: every byte of every chunk is in exactly one block; blocks of a chunk tile it in
// address order (prev/next); a block is free, allocated, or pending; free blocks are in `free_`
// (by size, then address) and have no free neighbour; allocated + pending bytes == in_use.
// Thread-safe: one mutex (blocks go back from tensor deleters on any thread).
#pragma once

#include "cuda_table.h"
#include "types.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pymem {

// Where chunks come from. Throws std::bad_alloc (or returns null) when the system refuses.
class HostChunkSource {
 public:
  virtual ~HostChunkSource() = default;
  virtual void* take(size_t bytes) = 0;
  virtual void give_back(void* p) = 0;
  virtual const pymem_cuda_table* cuda() const { return nullptr; }  // events, when copies are async
  virtual bool pinned() const = 0;
};

std::unique_ptr<HostChunkSource> make_malloc_chunks();                              // CPU device
std::unique_ptr<HostChunkSource> make_cuda_host_chunks(const pymem_cuda_table* t);  // pinned

struct HostPoolStats {
  size_t in_use = 0, peak_in_use = 0;  // bytes of allocated and pending blocks (rounded)
  size_t reserved = 0;                 // bytes of chunks
  size_t num_chunks = 0, num_allocs = 0, num_pending = 0;
  size_t num_refused = 0;              // allocations the cap refused
};

class HostPool {
 public:
  static constexpr size_t kAlign = kAlignment;  // the arena's grain (types.h)
  // cap_bytes 0: no cap.
  HostPool(std::unique_ptr<HostChunkSource> source, size_t chunk_bytes, size_t cap_bytes);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  void* allocate(size_t bytes);  // null: the cap (or the system) refused
  // Whether allocate(bytes) would find room under the cap (a free block, or a new chunk; pending
  // blocks not counted). A value that can only be offloaded (a leaf) is released only then.
  bool fits(size_t bytes) const;
  void release(void* p);         // free now, or pending until its recorded uses complete
  // An async copy using p's block was just enqueued on `stream` (a cudaStream_t; null: default).
  void record_use(void* p, void* stream);

  HostPoolStats stats() const;
  size_t cap() const { return cap_; }
  bool pinned() const { return source_->pinned(); }

 private:
  struct Block {
    uintptr_t addr = 0;
    size_t size = 0;
    size_t chunk = 0;  // index into chunks_
    enum class State : uint8_t { Free, Allocated, Pending } state = State::Free;
    Block* prev = nullptr;  // neighbours in the same chunk
    Block* next = nullptr;
    std::vector<void*> events;  // recorded uses not yet known complete
  };
  struct BySize {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->addr < b->addr;
    }
  };

  Block* take_free(size_t rounded);  // best fit, split; null when none holds it
  bool grow(size_t rounded);         // a new chunk under the cap
  void make_free(Block* b);          // coalesce and index
  void collect();                    // pending blocks whose events completed become free
  bool complete(Block* b);           // all of b's events done (destroys them)
  void* new_event();

  std::unique_ptr<HostChunkSource> source_;
  const size_t chunk_bytes_, cap_;
  mutable std::mutex mutex_;
  std::vector<std::pair<void*, size_t>> chunks_;
  std::vector<std::unique_ptr<Block>> blocks_;  // owner of every Block (reused through spare_)
  std::vector<Block*> spare_;
  std::set<Block*, BySize> free_;
  std::unordered_map<uintptr_t, Block*> allocated_;  // by address: allocated and pending
  std::vector<Block*> pending_;
  std::vector<void*> idle_events_;
  HostPoolStats stats_;
};

}  // namespace pymem
