// free_index.h — free blocks of a region, best-fit by (size, address).
//
// Why not one std::set: an allocate+free pair does ~5 index operations, and tree descents with a
// pointer chase per comparison made them 3/4 of the pair's time. Instead:
//   * sizes up to kMaxBinned have an exact-size bin each (sizes are multiples of 512), found with a
//     two-level bitmap: the smallest non-empty bin >= the request is a few bit scans;
//   * inside a bin, a binary min-heap by address gives the lowest address (Block::index_pos is the
//     block's heap slot, so removing any block is O(log k) for k blocks of that exact size);
//   * larger blocks (few, however many bytes) live in an ordered map keyed by (size, address).
#pragma once

#include <map>
#include <utility>
#include <vector>

#include "types.h"

namespace pymem {

class FreeIndex {
 public:
  FreeIndex();
  void insert(Block* b);
  void erase(Block* b);
  // Smallest block with size >= n, lowest address among equals; null if none.
  Block* best_fit(size_t n) const;
  size_t largest() const;
  // The free block that holds all of [addr, addr + n), or null. Scans the blocks of size >= n: the
  // step placement's lookup on each large allocation (step_placement.h; with ~50 free blocks it
  // added 0.07 us to a 0.67 us allocate from Python: a region holds few free blocks).
  Block* covering(uintptr_t addr, size_t n) const;
  // The free block of size >= n with the highest address, or null (same scan).
  Block* highest(size_t n) const;
  bool empty() const { return count_ == 0; }
  size_t count() const { return count_; }

 private:
  // Calls visit(b) for each free block of size >= n until it returns true; returns that block.
  template <class Visit>
  Block* find_at_least(size_t n, Visit visit) const;
  static constexpr size_t kMaxBinned = 8u << 20;               // 8 MiB
  static constexpr size_t kBins = kMaxBinned / kAlignment + 1;  // bin i holds size i * 512
  static constexpr size_t kWords = (kBins + 63) / 64;
  static constexpr size_t kSummaryWords = (kWords + 63) / 64;

  static size_t bin_of(size_t size) { return size / kAlignment; }
  size_t first_bin_at_least(size_t bin) const;  // kBins if none
  size_t last_bin() const;                      // kBins if none
  void set_bit(size_t bin);
  void clear_bit(size_t bin);
  void sift_up(std::vector<Block*>& h, size_t i);
  void sift_down(std::vector<Block*>& h, size_t i);

  uint64_t bits_[kWords] = {};
  uint64_t summary_[kSummaryWords] = {};
  std::vector<std::vector<Block*>> heaps_;
  std::map<std::pair<size_t, uintptr_t>, Block*> large_;
  size_t count_ = 0;
};

}  // namespace pymem
