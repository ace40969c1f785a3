// backing.cpp — host, virtual and CUDA slabs.
#include "backing.h"

#include <sys/mman.h>

#include <cstring>

#include <stdexcept>
#include <string>

#include "cuda_table.h"

namespace pymem {

namespace {

class HostBacking final : public Backing {
 public:
  explicit HostBacking(size_t bytes) {
    // MAP_NORESERVE: a 20 GB budget costs nothing until tensors touch their pages.
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED)
      throw std::runtime_error("pymem: cannot map a host slab of " + std::to_string(bytes) + " bytes");
    base_ = reinterpret_cast<uintptr_t>(p);
    size_ = bytes;
  }
  ~HostBacking() override { munmap(reinterpret_cast<void*>(base_), size_); }
  const char* kind() const override { return "host"; }
  bool can_move() const override { return true; }
  void move(uintptr_t dst, uintptr_t src, size_t n) override {
    std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  }
};

class VirtualBacking final : public Backing {
 public:
  explicit VirtualBacking(size_t bytes) {
    base_ = kVirtualBase;
    size_ = bytes;
  }
  const char* kind() const override { return "virtual"; }
  bool can_move() const override { return true; }  // no bytes: moving is address arithmetic only
  void move(uintptr_t, uintptr_t, size_t) override {}
};

class CudaBacking final : public Backing {
 public:
  CudaBacking(size_t bytes, int device, const pymem_cuda_table* table) : table_(table) {
    int prev = 0;
    table_->get_device(&prev);
    if (prev != device) table_->set_device(device);
    void* p = nullptr;
    int err = table_->malloc(&p, bytes);
    if (prev != device) table_->set_device(prev);
    if (err != 0 || !p)
      throw std::runtime_error("pymem: cudaMalloc of the " + std::to_string(bytes) +
                               "-byte arena slab on device " + std::to_string(device) +
                               " failed with CUDA error " + std::to_string(err));
    base_ = reinterpret_cast<uintptr_t>(p);
    size_ = bytes;
  }
  ~CudaBacking() override { table_->free(reinterpret_cast<void*>(base_)); }
  const char* kind() const override { return "cuda"; }
  bool can_move() const override { return true; }
  void set_move_stream(void* stream) override { stream_ = stream; }

  // cudaMemcpyAsync leaves overlapping ranges undefined, and a slide overlaps whenever a block is
  // larger than the distance it moves. Copying in pieces of that distance, in the order memmove
  // would (ascending when moving down), each piece lands only on bytes already copied out.
  void move(uintptr_t dst, uintptr_t src, size_t n) override {
    if (dst == src || n == 0) return;
    const size_t dist = dst > src ? dst - src : src - dst;
    const size_t piece = dist >= n ? n : dist;
    const size_t pieces = (n + piece - 1) / piece;
    for (size_t i = 0; i < pieces; i++) {
      const size_t k = dst < src ? i : pieces - 1 - i;
      const size_t off = k * piece, len = off + piece > n ? n - off : piece;
      int err = table_->memcpy_async(reinterpret_cast<void*>(dst + off), reinterpret_cast<const void*>(src + off),
                                     len, PYMEM_CUDA_MEMCPY_DEVICE_TO_DEVICE, stream_);
      if (err != 0)
        throw std::runtime_error("pymem: cudaMemcpyAsync of a compaction move failed with CUDA error " +
                                 std::to_string(err));
    }
  }

 private:
  const pymem_cuda_table* table_;
  void* stream_ = nullptr;  // the legacy default stream until the runtime names one
};

}  // namespace

// A backing that cannot move bytes; Arena::compact checks can_move() before it changes anything,
// so this is never reached through it.
void Backing::move(uintptr_t, uintptr_t, size_t) {
  throw std::logic_error(std::string("pymem: a ") + kind() + " backing cannot move bytes");
}

std::unique_ptr<Backing> make_host_backing(size_t bytes) { return std::make_unique<HostBacking>(bytes); }
std::unique_ptr<Backing> make_virtual_backing(size_t bytes) {
  return std::make_unique<VirtualBacking>(bytes);
}
std::unique_ptr<Backing> make_cuda_backing(size_t bytes, int device, const pymem_cuda_table* table) {
  return std::make_unique<CudaBacking>(bytes, device, table);
}

}  // namespace pymem
