// host_pool.cpp — chunks, best fit, coalescing, reuse after completion (see host_pool.h).
#include "host_pool.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <stdexcept>

namespace pymem {

namespace {

constexpr unsigned kEventDisableTiming = 0x02;  // cudaEventDisableTiming: events order, not time

class MallocChunks final : public HostChunkSource {
 public:
  void* take(size_t bytes) override { return std::aligned_alloc(HostPool::kAlign, bytes); }
  void give_back(void* p) override { std::free(p); }
  bool pinned() const override { return false; }
};

class CudaHostChunks final : public HostChunkSource {
 public:
  explicit CudaHostChunks(const pymem_cuda_table* t) : t_(t) {}
  void* take(size_t bytes) override {
    void* p = nullptr;
    return t_->host_alloc(&p, bytes, 0) == 0 ? p : nullptr;  // cudaHostAllocDefault
  }
  void give_back(void* p) override { t_->free_host(p); }
  const pymem_cuda_table* cuda() const override { return t_; }
  bool pinned() const override { return true; }

 private:
  const pymem_cuda_table* t_;
};

size_t round_up(size_t n) { return (std::max<size_t>(n, 1) + HostPool::kAlign - 1) / HostPool::kAlign * HostPool::kAlign; }

}  // namespace

std::unique_ptr<HostChunkSource> make_malloc_chunks() { return std::make_unique<MallocChunks>(); }
std::unique_ptr<HostChunkSource> make_cuda_host_chunks(const pymem_cuda_table* t) {
  if (t == nullptr || t->host_alloc == nullptr || t->free_host == nullptr)
    throw std::invalid_argument("pymem: a pinned host pool needs a CUDA table with host_alloc and free_host");
  return std::make_unique<CudaHostChunks>(t);
}

HostPool::HostPool(std::unique_ptr<HostChunkSource> source, size_t chunk_bytes, size_t cap_bytes)
    : source_(std::move(source)), chunk_bytes_(round_up(chunk_bytes)), cap_(cap_bytes) {}

HostPool::~HostPool() {
  // Copies still in flight would write freed memory: wait for them (the pool closes at disable).
  if (const pymem_cuda_table* t = source_->cuda()) {
    for (const auto& b : blocks_)
      for (void* e : b->events) {
        t->event_synchronize(e);
        t->event_destroy(e);
      }
    for (void* e : idle_events_) t->event_destroy(e);
  }
  for (const auto& [p, size] : chunks_) source_->give_back(p);
}

void* HostPool::allocate(size_t bytes) {
  const size_t rounded = round_up(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  Block* b = take_free(rounded);
  if (b == nullptr && !pending_.empty()) {
    collect();
    b = take_free(rounded);
  }
  if (b == nullptr && grow(rounded)) b = take_free(rounded);
  if (b == nullptr) {
    ++stats_.num_refused;
    return nullptr;
  }
  allocated_[b->addr] = b;
  stats_.in_use += b->size;
  stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
  ++stats_.num_allocs;
  return reinterpret_cast<void*>(b->addr);
}

bool HostPool::fits(size_t bytes) const {
  const size_t rounded = round_up(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!free_.empty() && (*free_.rbegin())->size >= rounded) return true;
  return cap_ == 0 || stats_.reserved + rounded <= cap_;
}

void HostPool::release(void* p) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = allocated_.find(reinterpret_cast<uintptr_t>(p));
  if (it == allocated_.end() || it->second->state != Block::State::Allocated)
    throw std::invalid_argument("pymem: HostPool.release of an address the pool did not hand out");
  Block* b = it->second;
  if (!b->events.empty() && !complete(b)) {  // a copy still reads or writes it
    b->state = Block::State::Pending;
    pending_.push_back(b);
    ++stats_.num_pending;
    return;
  }
  allocated_.erase(it);
  stats_.in_use -= b->size;
  make_free(b);
}

void HostPool::record_use(void* p, void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = allocated_.find(reinterpret_cast<uintptr_t>(p));
  if (it == allocated_.end())
    throw std::invalid_argument("pymem: HostPool.record_use of an address the pool did not hand out");
  const pymem_cuda_table* t = source_->cuda();
  if (t == nullptr) return;  // synchronous copies: complete when the caller moves on
  void* e = new_event();
  if (t->event_record(e, stream) != 0) {
    t->event_destroy(e);
    throw std::runtime_error("pymem: cudaEventRecord failed for a host copy");
  }
  it->second->events.push_back(e);
}

HostPoolStats HostPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

HostPool::Block* HostPool::take_free(size_t rounded) {
  Block key;
  key.size = rounded;
  auto it = free_.lower_bound(&key);
  if (it == free_.end()) return nullptr;
  Block* b = *it;
  free_.erase(it);
  if (b->size > rounded) {  // split: the rest stays free, right after
    Block* rest;
    if (!spare_.empty()) {
      rest = spare_.back();
      spare_.pop_back();
      *rest = Block{};
    } else {
      blocks_.push_back(std::make_unique<Block>());
      rest = blocks_.back().get();
    }
    rest->addr = b->addr + rounded;
    rest->size = b->size - rounded;
    rest->chunk = b->chunk;
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = rounded;
    free_.insert(rest);
  }
  b->state = Block::State::Allocated;
  return b;
}

bool HostPool::grow(size_t rounded) {
  size_t bytes = std::max(chunk_bytes_, rounded);
  if (cap_ != 0) {
    if (stats_.reserved + rounded > cap_) return false;
    bytes = std::min(bytes, (cap_ - stats_.reserved) / kAlign * kAlign);  // the last chunk fits the cap
  }
  void* p = nullptr;
  try {
    p = source_->take(bytes);
  } catch (const std::bad_alloc&) {
    p = nullptr;
  }
  if (p == nullptr) return false;
  chunks_.emplace_back(p, bytes);
  blocks_.push_back(std::make_unique<Block>());
  Block* b = blocks_.back().get();
  b->addr = reinterpret_cast<uintptr_t>(p);
  b->size = bytes;
  b->chunk = chunks_.size() - 1;
  free_.insert(b);
  stats_.reserved += bytes;
  ++stats_.num_chunks;
  return true;
}

void HostPool::make_free(Block* b) {
  b->state = Block::State::Free;
  for (Block* n : {b->next, b->prev}) {
    if (n == nullptr || n->state != Block::State::Free) continue;
    free_.erase(n);
    Block* lo = n == b->prev ? n : b;
    Block* hi = n == b->prev ? b : n;
    lo->size += hi->size;
    lo->next = hi->next;
    if (hi->next) hi->next->prev = lo;
    spare_.push_back(hi);
    b = lo;
  }
  free_.insert(b);
}

void HostPool::collect() {
  auto done = std::partition(pending_.begin(), pending_.end(), [&](Block* b) { return !complete(b); });
  for (auto it = done; it != pending_.end(); ++it) {
    Block* b = *it;
    allocated_.erase(b->addr);
    stats_.in_use -= b->size;
    --stats_.num_pending;
    make_free(b);
  }
  pending_.erase(done, pending_.end());
}

bool HostPool::complete(Block* b) {
  const pymem_cuda_table* t = source_->cuda();
  auto still = std::remove_if(b->events.begin(), b->events.end(), [&](void* e) {
    if (t->event_query(e) != 0) return false;  // not ready (or an error: treated as not done)
    idle_events_.push_back(e);
    return true;
  });
  b->events.erase(still, b->events.end());
  return b->events.empty();
}

void* HostPool::new_event() {
  if (!idle_events_.empty()) {
    void* e = idle_events_.back();
    idle_events_.pop_back();
    return e;
  }
  void* e = nullptr;
  if (source_->cuda()->event_create(&e, kEventDisableTiming) != 0)
    throw std::runtime_error("pymem: cudaEventCreateWithFlags failed for the host pool");
  return e;
}

}  // namespace pymem
