// window.cpp — Coop's sliding-window victim search.
//
// For every right edge r we keep the shortest window [l, r] that still covers the request: adding r
// and then dropping blocks from the left while the rest still covers. Every other covering window
// ending at r contains this one, and costs are >= 0 (the arena rejects negative ones), so this is
// the cheapest ending at r. The window cost is a running sum (costs are non-negative, so cancellation cannot reorder
// windows in any way that matters); the winner's cost is re-summed exactly when its victims are
// collected.
#include "window.h"

namespace pymem {

namespace {

Window collect(const Block* l, const Block* r) {
  Window w;
  w.found = true;
  w.addr = l->addr;
  for (const Block* b = l;; b = b->next) {
    w.bytes += b->size;
    if (b->allocated) {
      w.cost += b->cost;
      w.victims.push_back(Victim{b->owner, b->addr, b->size, b->cost});
    }
    if (b == r) break;
  }
  return w;
}

Window search_sliding(const Region& region, size_t need) {
  const Block* best_l = nullptr;
  const Block* best_r = nullptr;
  double best_cost = 0.0;
  size_t best_bytes = 0;

  const Block* l = region.first();
  size_t bytes = 0;
  double cost = 0.0;
  for (const Block* r = region.first(); r; r = r->next) {
    if (!releasable(*r)) {  // a wall: restart after it
      l = r->next;
      bytes = 0;
      cost = 0.0;
      continue;
    }
    bytes += r->size;
    if (r->allocated) cost += r->cost;
    while (l != r && bytes - l->size >= need) {
      bytes -= l->size;
      if (l->allocated) cost -= l->cost;
      l = l->next;
    }
    if (bytes < need) continue;
    if (!best_l || cost < best_cost || (cost == best_cost && bytes < best_bytes)) {
      best_l = l;
      best_r = r;
      best_cost = cost;
      best_bytes = bytes;
    }
  }
  return best_l ? collect(best_l, best_r) : Window{};
}

Window search_single(const Region& region) {
  const Block* best = nullptr;
  for (const Block* b = region.first(); b; b = b->next) {
    if (!b->allocated || !releasable(*b)) continue;
    if (!best || b->cost < best->cost || (b->cost == best->cost && b->size > best->size)) best = b;
  }
  return best ? collect(best, best) : Window{};
}

}  // namespace

Window search_window(const Region& region, size_t need, SearchMode mode) {
  return mode == SearchMode::Window ? search_sliding(region, need) : search_single(region);
}

}  // namespace pymem
