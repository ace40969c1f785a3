// addr_map.h — start address -> allocated Block*, open addressing with linear probing.
//
// Why not std::unordered_map: every insert/erase there is a malloc/free of a node, which doubled
// the cost of an allocate+free pair. Here the table is one array; erase uses backward-shift
// deletion (no tombstones), so probe lengths stay short at load <= 1/2.
#pragma once

#include <cstdint>
#include <vector>

#include "types.h"

namespace pymem {

class AddrMap {
 public:
  AddrMap() { slots_.assign(kInitial, Slot{}); }

  Block* find(uintptr_t addr) const {
    if (addr == kEmpty) return nullptr;
    for (size_t i = home(addr);; i = (i + 1) & mask()) {
      const Slot& s = slots_[i];
      if (s.key == addr) return s.block;
      if (s.key == kEmpty) return nullptr;
    }
  }

  void insert(uintptr_t addr, Block* b) {  // addr must not be present
    if (2 * (size_ + 1) > slots_.size()) grow();
    place(addr, b);
    ++size_;
  }

  // Removes addr and returns its block, or returns null if absent: one probe run for the free
  // path's lookup and erase together.
  Block* take(uintptr_t addr) {
    if (addr == kEmpty) return nullptr;
    size_t i = home(addr);
    for (;; i = (i + 1) & mask()) {
      if (slots_[i].key == addr) break;
      if (slots_[i].key == kEmpty) return nullptr;
    }
    Block* found = slots_[i].block;
    // Backward-shift: pull later entries of the same probe run into the hole.
    for (size_t j = (i + 1) & mask();; j = (j + 1) & mask()) {
      if (slots_[j].key == kEmpty) break;
      const size_t h = home(slots_[j].key);
      // Move j into i unless its home lies cyclically in (i, j].
      const bool stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Slot{};
    --size_;
    return found;
  }

  size_t size() const { return size_; }

  template <class F>
  void for_each(F f) const {
    for (const Slot& s : slots_)
      if (s.key != kEmpty) f(s.key, s.block);
  }

 private:
  struct Slot {
    uintptr_t key = kEmpty;
    Block* block = nullptr;
  };
  // 0 is never a block address: backings start at non-null bases.
  static constexpr uintptr_t kEmpty = 0;
  static constexpr size_t kInitial = 1024;

  size_t mask() const { return slots_.size() - 1; }
  size_t home(uintptr_t addr) const {
    // Addresses are 512-aligned: drop those bits, then mix (Fibonacci hashing).
    return size_t(((addr >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & mask();
  }
  void place(uintptr_t addr, Block* b) {
    size_t i = home(addr);
    while (slots_[i].key != kEmpty) i = (i + 1) & mask();
    slots_[i] = Slot{addr, b};
  }
  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(old.size() * 2, Slot{});
    for (const Slot& s : old)
      if (s.key != kEmpty) place(s.key, s.block);
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
};

}  // namespace pymem
