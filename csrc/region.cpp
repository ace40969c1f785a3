// region.cpp — block list, best-fit index, coalescing. Placement lives in placement.cpp.
#include "region.h"

#include <algorithm>

namespace pymem {

namespace {
constexpr size_t kBlocksPerChunk = 1024;
}

Region::Region(uintptr_t base, size_t size, RegionKind kind) : base_(base), size_(size), kind_(kind) {
  first_ = new_block();
  first_->addr = base;
  first_->size = size;
  first_->region = kind;
  free_.insert(first_);
  free_bytes_ = size;
}

Region::~Region() {
  for (Block* c : chunks_) delete[] c;
}

Block* Region::new_block() {
  if (!spare_) {
    Block* chunk = new Block[kBlocksPerChunk];
    chunks_.push_back(chunk);
    for (size_t i = 0; i < kBlocksPerChunk; ++i) {
      chunk[i].next = spare_;
      spare_ = &chunk[i];
    }
  }
  Block* b = spare_;
  spare_ = b->next;
  *b = Block{};
  b->region = kind_;
  ++num_blocks_;
  return b;
}

void Region::delete_block(Block* b) {
  b->next = spare_;
  spare_ = b;
  --num_blocks_;
}

Block* Region::allocate(size_t rounded, CostClass cls) {
  Block* b = free_.best_fit(rounded);  // smallest free block >= rounded, lowest address first
  return b ? place(b, rounded, cls) : nullptr;
}

Block* Region::free(Block* b) {
  b->allocated = false;
  b->pinned = false;
  b->owner = 0;
  b->cost = 0.0;
  b->requested = 0;
  free_bytes_ += b->size;
  if (Block* p = b->prev; p && !p->allocated) {  // absorb b into its free predecessor
    free_.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    delete_block(b);
    b = p;
  }
  if (Block* n = b->next; n && !n->allocated) {  // absorb the free successor into b
    free_.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    delete_block(n);
  }
  free_.insert(b);
  return b;
}

Block* Region::split_after(Block* b, size_t keep) {
  Block* nb = new_block();
  nb->addr = b->addr + keep;
  nb->size = b->size - keep;
  nb->prev = b;
  nb->next = b->next;
  if (b->next) b->next->prev = nb;
  b->next = nb;
  b->size = keep;
  return nb;
}

Block* Region::allocate_within(const std::vector<std::pair<size_t, size_t>>& ranges, size_t rounded) {
  size_t r = 0;
  for (Block* b = first_; b != nullptr && r < ranges.size(); b = b->next) {
    if (b->allocated || b->size < rounded) continue;
    const size_t lo = b->addr - base_, hi = lo + b->size;
    while (r < ranges.size() && ranges[r].second <= lo) ++r;  // ranges wholly below this block
    for (size_t q = r; q < ranges.size() && ranges[q].first < hi; ++q) {
      const size_t from = std::max(lo, ranges[q].first), to = std::min(hi, ranges[q].second);
      if (to >= from + rounded) return carve(b, base_ + from, rounded);
    }
  }
  return nullptr;
}

Block* Region::carve(Block* fb, uintptr_t addr, size_t rounded) {
  free_.erase(fb);  // keyed by (size, address): out before either changes
  free_bytes_ -= rounded;
  if (addr > fb->addr) {  // [free fb | rest]
    Block* rest = split_after(fb, addr - fb->addr);
    free_.insert(fb);
    fb = rest;
  }
  if (fb->size > rounded) free_.insert(split_after(fb, rounded));  // [fb | free tail]
  fb->allocated = true;
  return fb;
}

}  // namespace pymem
