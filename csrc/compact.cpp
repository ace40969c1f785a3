// compact.cpp — moving allocated blocks to merge the free space between them.
//
// Under a hard budget, fragmentation cannot be outgrown: blocks that may not be released
// (parameters, gradients, optimizer state) scattered across the arena split its free bytes into
// holes no large request fits. Compaction slides such blocks up, keeping their order, so each run
// of listed blocks between two unlisted ones (which stay put: inputs of the running kernel,
// allocations whose owner is unknown) ends with one free block below it.
//
// Why top-down in place: walking from the highest block down, each listed block moves up to the
// cursor (the start of the block above it after its own move); its destination can overlap only its
// own old bytes, never a block not yet moved, so memmove semantics suffice and no scratch is needed.
#include <unordered_set>

#include "arena.h"

namespace pymem {

Block* Arena::movable_block_locked(uintptr_t addr, const char* what) const {
  if (!backing_->can_move())
    throw InvalidArgument(std::string(what) + ": a " + backing_->kind() + " arena cannot move block contents");
  Block* b = find_allocated_locked(addr, what);
  if (b->region != RegionKind::Main)
    throw InvalidArgument(std::string(what) + ": " + format_address(addr) +
                          " is in the small region, which never compacts");
  if (b->pinned) throw InvalidArgument(std::string(what) + ": " + format_address(addr) + " is pinned");
  return b;
}

// Moves b's bytes to `to` (inside free block fb) and re-cuts the region; returns the new block.
Block* Arena::relocate_locked(Block* b, Block* fb, uintptr_t to) {
  backing_->move(to, b->addr, b->size);
  const Block keep = *b;
  allocated_.take(keep.addr);
  // Carve first when the destination does not touch b (b's free may merge into fb otherwise).
  Block* nb;
  if (fb) {
    nb = main_->carve(fb, to, keep.size);
    main_->free(b);
  } else {
    nb = main_->carve(main_->free(b), to, keep.size);
  }
  nb->owner = keep.owner;
  nb->cost = keep.cost;
  nb->requested = keep.requested;
  nb->serial = keep.serial;
  allocated_.insert(to, nb);
  stats_.num_moved_blocks++;
  stats_.moved_bytes += keep.size;
  return nb;
}

void Arena::move_block(uintptr_t from, uintptr_t to) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* b = movable_block_locked(from, "move_block");
  Block* fb = main_->first();
  while (fb && !(fb->addr <= to && to < fb->addr + fb->size)) fb = fb->next;
  if (!fb || fb->allocated || to % kAlignment != 0 || to + b->size > fb->addr + fb->size)
    throw InvalidArgument("move_block: [" + format_address(to) + ", +" + std::to_string(b->size) +
                          ") is not inside one free block of the main region");
  relocate_locked(b, fb, to);
  stats_.num_compactions++;
}

std::vector<std::pair<uintptr_t, uintptr_t>> Arena::compact(const std::vector<uintptr_t>& addrs) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::unordered_set<uintptr_t> listed;
  listed.reserve(addrs.size());
  for (uintptr_t a : addrs) {  // validate everything before the first move
    movable_block_locked(a, "compact");
    listed.insert(a);
  }
  std::vector<std::pair<uintptr_t, uintptr_t>> moves;
  if (listed.empty()) return moves;

  Block* b = main_->first();
  while (b->next) b = b->next;
  uintptr_t cursor = main_->base() + main_->size();  // nothing at or above it may move
  while (b) {
    if (!b->allocated || !listed.count(b->addr)) {
      if (b->allocated) cursor = b->addr;
      b = b->prev;
      continue;
    }
    const uintptr_t from = b->addr, to = cursor - b->size;
    if (to == from) {
      cursor = from;
      b = b->prev;
      continue;
    }
    Block* nb = relocate_locked(b, nullptr, to);  // everything between b and cursor is free
    moves.emplace_back(from, to);
    cursor = to;
    b = nb->prev;
  }
  if (!moves.empty()) stats_.num_compactions++;
  return moves;
}

}  // namespace pymem
