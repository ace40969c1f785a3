// backing.h — where an arena's bytes come from. A backing owns one address range of exactly the
// budget; the arena never asks for more. Three kinds:
//   host    — an mmap'd slab (pages are committed on first touch): the CPU device.
//   virtual — address arithmetic only, no memory at all, at a fixed synthetic base so addresses
//             are deterministic: lets tests and the simulator run 80 GB arenas on a laptop.
//   cuda    — one cudaMalloc slab, through the run-time function table of cuda_table.h; moves are
//             device-to-device copies queued on the move stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

struct pymem_cuda_table;

namespace pymem {

class Backing {
 public:
  virtual ~Backing() = default;
  uintptr_t base() const { return base_; }
  size_t size() const { return size_; }
  virtual const char* kind() const = 0;
  // Compaction (Arena::compact) moves block contents inside the slab. `dst` and `src` may overlap.
  virtual bool can_move() const { return false; }
  virtual void move(uintptr_t dst, uintptr_t src, size_t n);
  // The stream a CUDA backing's moves are ordered on (the compacting thread's current stream): every
  // kernel queued there before a move reads the old bytes, every one after it the new. Others ignore it.
  virtual void set_move_stream(void* stream) {}

 protected:
  uintptr_t base_ = 0;
  size_t size_ = 0;
};

// Synthetic base of virtual backings: high enough never to collide with a real small pointer,
// 512-aligned, and the same every run.
constexpr uintptr_t kVirtualBase = uintptr_t(1) << 40;

std::unique_ptr<Backing> make_host_backing(size_t bytes);
std::unique_ptr<Backing> make_virtual_backing(size_t bytes);
// `table` must outlive the backing. Throws std::runtime_error if cudaMalloc fails.
std::unique_ptr<Backing> make_cuda_backing(size_t bytes, int device, const pymem_cuda_table* table);

}  // namespace pymem
