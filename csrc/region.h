// region.h — a contiguous address range tiled by blocks in address order (a doubly linked list),
// with free blocks indexed best-fit by (size, address).
//
// Invariants (checked by tests against a Python model):
//   * blocks tile [base, base + size) exactly, in address order, with no gaps or overlaps;
//   * every addr and size is a multiple of kAlignment;
//   * no two neighbours are both free;
//   * free_ holds exactly the free blocks.
// Not thread-safe: the owning Arena's mutex guards it.
#pragma once

#include <utility>
#include <vector>

#include "free_index.h"
#include "types.h"

namespace pymem {

class Region {
 public:
  Region(uintptr_t base, size_t size, RegionKind kind);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  // Best-fit a free block of at least `rounded` bytes and carve the block out of it at the end the
  // cost class asks for (placement.cpp). Returns null when no free block is large enough.
  Block* allocate(size_t rounded, CostClass cls);
  // Return an allocated block; coalesces with free neighbours. Returns the free block that now
  // covers b's range.
  Block* free(Block* b);
  // Allocate exactly [addr, addr + rounded) out of the free block `fb`, which must cover it; the
  // parts of fb below and above stay free. Compaction's placement (Arena::compact).
  Block* carve(Block* fb, uintptr_t addr, size_t rounded);
  // Allocate exactly [addr, addr + rounded) if one free block covers it; else null (the step
  // placement's planned offset, step_placement.h).
  Block* allocate_at(uintptr_t addr, size_t rounded) {
    Block* fb = free_.covering(addr, rounded);
    return fb ? carve(fb, addr, rounded) : nullptr;
  }
  // Allocate at the top of the highest free block that holds `rounded` bytes, or null: where blocks
  // the step placement did not plan stay out of the planned ones' way (those fill from the bottom).
  Block* allocate_top(size_t rounded) {
    Block* fb = free_.highest(rounded);
    return fb ? carve(fb, fb->addr + fb->size - rounded, rounded) : nullptr;
  }

  // Allocate `rounded` bytes at the lowest address where a free block and one of `ranges` (offsets
  // from base, ascending, disjoint) overlap by that much, or null: a displaced block of the step
  // placement, put where its plan keeps room (step_placement.h). Walks the blocks: a rare path.
  Block* allocate_within(const std::vector<std::pair<size_t, size_t>>& ranges, size_t rounded);

  Block* first() const { return first_; }
  uintptr_t base() const { return base_; }
  size_t size() const { return size_; }
  RegionKind kind() const { return kind_; }
  size_t free_bytes() const { return free_bytes_; }
  size_t num_blocks() const { return num_blocks_; }
  size_t largest_free() const { return free_.largest(); }
  bool contains(uintptr_t addr) const { return addr >= base_ && addr < base_ + size_; }

 private:
  Block* place(Block* free_block, size_t rounded, CostClass cls);  // placement.cpp
  Block* new_block();
  Block* split_after(Block* b, size_t keep);  // b keeps `keep` bytes; returns the upper part
  void delete_block(Block* b);

  uintptr_t base_;
  size_t size_;
  RegionKind kind_;
  Block* first_ = nullptr;
  FreeIndex free_;
  size_t free_bytes_ = 0;
  size_t num_blocks_ = 0;
  // Block storage: chunks of Blocks plus a free list, so splitting never calls malloc on the fast
  // path and blocks of a region sit close together for the window walk.
  std::vector<Block*> chunks_;
  Block* spare_ = nullptr;  // singly linked through Block::next
};

}  // namespace pymem
