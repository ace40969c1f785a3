// move_plan.cpp — see move_plan.h. Each step mirrors compaction_plan.py's function of the same
// name, so that both pick the same segment, moves and window.
#include "move_plan.h"

#include <algorithm>
#include <limits>
#include <unordered_map>

namespace pymem {
namespace {

struct Piece {  // one block of a segment
  uintptr_t addr;
  uint64_t size;
  bool allocated;
};

struct Segment {
  std::vector<Piece> pieces;  // free and movable blocks, address order
  uint64_t free = 0;
};

struct Hole {
  uintptr_t addr;
  uint64_t size;
};

std::vector<Segment> segments_of(const std::vector<Block>& blocks, const std::unordered_set<uintptr_t>& movable,
                                 const std::unordered_set<uintptr_t>& freed) {
  std::vector<Segment> segments(1);
  for (const Block& b : blocks) {
    if (b.region != RegionKind::Main) break;
    const bool allocated = b.allocated && freed.count(b.addr) == 0;
    if (!allocated) {
      segments.back().pieces.push_back({b.addr, b.size, false});
      segments.back().free += b.size;
      continue;
    }
    if (movable.count(b.addr) == 0) {  // cannot move: ends the segment
      segments.emplace_back();
      continue;
    }
    segments.back().pieces.push_back({b.addr, b.size, true});
  }
  return segments;
}

// _evacuate: the target's blocks into other segments' free blocks, largest first, best fit.
// Returns the deficit left (<= 0: covered).
int64_t evacuate(const Segment& target, const std::vector<Segment>& segments, int64_t deficit,
                 std::vector<std::pair<uintptr_t, uintptr_t>>& moves) {
  if (deficit <= 0) return deficit;
  std::vector<Hole> holes;
  for (const Segment& s : segments) {
    if (&s == &target) continue;
    for (const Piece& p : s.pieces)
      if (!p.allocated) holes.push_back({p.addr, p.size});
  }
  if (holes.empty()) return deficit;
  std::vector<Piece> order;
  for (const Piece& p : target.pieces)
    if (p.allocated) order.push_back(p);
  std::stable_sort(order.begin(), order.end(), [](const Piece& a, const Piece& b) { return a.size > b.size; });
  for (const Piece& p : order) {
    if (deficit <= 0) break;
    Hole* fit = nullptr;
    for (Hole& h : holes)
      if (h.size >= p.size && (fit == nullptr || h.size < fit->size)) fit = &h;
    if (fit == nullptr) continue;
    moves.emplace_back(p.addr, fit->addr);
    fit->addr += p.size;
    fit->size -= p.size;
    deficit -= static_cast<int64_t>(p.size);
  }
  return deficit;
}

// cheapest_window: the run (ending with a free block) holding `request` free bytes with the fewest
// allocated bytes; the whole segment where none does. Returns its allocated blocks.
std::vector<uintptr_t> cheapest_window(const Segment& seg, const std::unordered_set<uintptr_t>& gone,
                                       uint64_t request, uint64_t* slid_bytes) {
  const size_t n = seg.pieces.size();
  std::vector<char> used(n);
  for (size_t k = 0; k < n; ++k) used[k] = seg.pieces[k].allocated && gone.count(seg.pieces[k].addr) == 0;
  bool found = false;
  size_t best_lo = 0, best_hi = n == 0 ? 0 : n - 1;
  uint64_t best_cost = 0;
  size_t i = 0;
  uint64_t free = 0, in_use = 0;
  for (size_t j = 0; j < n; ++j) {
    const uint64_t size = seg.pieces[j].size;
    if (used[j]) {
      in_use += size;
      continue;
    }
    free += size;
    while (i < j) {  // drop leading allocated blocks, and leading free ones not needed
      const uint64_t s_i = seg.pieces[i].size;
      if (used[i]) {
        in_use -= s_i;
      } else if (free - s_i >= request) {
        free -= s_i;
      } else {
        break;
      }
      ++i;
    }
    if (free >= request && (!found || in_use < best_cost)) {
      found = true;
      best_lo = i;
      best_hi = j;
      best_cost = in_use;
    }
  }
  std::vector<uintptr_t> out;
  *slid_bytes = 0;
  for (size_t k = best_lo; n > 0 && k <= best_hi; ++k)
    if (used[k]) {
      out.push_back(seg.pieces[k].addr);
      *slid_bytes += seg.pieces[k].size;
    }
  return out;
}

}  // namespace

std::optional<CompactionPlan> plan_compaction(const std::vector<Block>& blocks,
                                              const std::unordered_set<uintptr_t>& movable,
                                              const std::unordered_set<uintptr_t>& freed,
                                              const std::vector<uintptr_t>& order, uint64_t request,
                                              const std::function<double(size_t)>& cost_of) {
  const std::vector<Segment> segments = segments_of(blocks, movable, freed);
  // Each segment's releasable blocks, in `order`'s order: (index into order, size).
  std::vector<std::vector<std::pair<size_t, uint64_t>>> pools(segments.size());
  if (!order.empty()) {
    std::unordered_map<uintptr_t, std::pair<size_t, uint64_t>> where;  // allocated piece -> (segment, size)
    for (size_t si = 0; si < segments.size(); ++si)
      for (const Piece& p : segments[si].pieces)
        if (p.allocated) where.emplace(p.addr, std::make_pair(si, p.size));
    for (size_t i = 0; i < order.size(); ++i) {
      const auto it = where.find(order[i]);
      if (it != where.end()) pools[it->second.first].emplace_back(i, it->second.second);
    }
  }
  std::optional<CompactionPlan> best;
  for (size_t si = 0; si < segments.size(); ++si) {
    const Segment& seg = segments[si];
    std::vector<std::pair<uintptr_t, uintptr_t>> moves;
    int64_t deficit = evacuate(seg, segments, static_cast<int64_t>(request) - static_cast<int64_t>(seg.free), moves);
    std::unordered_set<uintptr_t> gone;  // moved out, then released too
    for (const auto& [from, to] : moves) gone.insert(from);
    std::vector<size_t> released;
    double cost = 0.0;
    if (deficit > 0) {
      uint64_t releasable = 0;
      for (const auto& [i, size] : pools[si])
        if (gone.count(order[i]) == 0) releasable += size;
      if (releasable < static_cast<uint64_t>(deficit)) continue;  // no release here makes it fit
      for (const auto& [i, size] : pools[si]) {
        if (gone.count(order[i])) continue;
        released.push_back(i);
        cost += cost_of(i);
        deficit -= static_cast<int64_t>(size);
        if (deficit <= 0) break;
      }
    }
    if (best && cost > best->release_cost) continue;
    uint64_t moved = 0;
    for (const Piece& p : seg.pieces)  // the moves out (one pass: every candidate is priced)
      if (gone.count(p.addr)) moved += p.size;
    for (size_t i : released) gone.insert(order[i]);
    uint64_t slid = 0;
    std::vector<uintptr_t> window = cheapest_window(seg, gone, request, &slid);
    moved += slid;
    if (best && !(cost < best->release_cost || moved < best->moves.bytes_to_move)) continue;
    CompactionPlan plan;
    for (const Piece& p : seg.pieces)
      if (p.allocated) plan.moves.segment_movable.push_back(p.addr);
    plan.moves.moves = std::move(moves);
    plan.moves.window = std::move(window);
    plan.moves.bytes_to_move = moved;
    plan.released = std::move(released);
    plan.release_cost = cost;
    best = std::move(plan);
  }
  return best;
}

std::optional<MovePlan> plan_moves(const std::vector<Block>& blocks, const std::unordered_set<uintptr_t>& movable,
                                   const std::unordered_set<uintptr_t>& freed, uint64_t request) {
  std::optional<CompactionPlan> p = plan_compaction(blocks, movable, freed, {}, request, nullptr);
  if (!p) return std::nullopt;
  return std::move(p->moves);
}

ReleasePath release_path(const std::vector<Block>& blocks, const std::vector<uintptr_t>& order, uint64_t request,
                         std::vector<size_t>& taken) {
  std::vector<const Block*> main;
  for (const Block& b : blocks) {
    if (b.region != RegionKind::Main) break;
    main.push_back(&b);
  }
  std::unordered_map<uintptr_t, size_t> index;
  index.reserve(main.size());
  std::vector<char> free(main.size());
  for (size_t i = 0; i < main.size(); ++i) {
    index.emplace(main[i]->addr, i);
    free[i] = !main[i]->allocated;
  }
  uint64_t released = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const auto it = index.find(order[k]);
    if (it == index.end() || free[it->second]) continue;
    const size_t i = it->second;
    free[i] = 1;
    taken.push_back(k);
    released += main[i]->size;
    uint64_t run = main[i]->size;  // the free run around it
    for (size_t lo = i; lo > 0 && free[lo - 1]; --lo) run += main[lo - 1]->size;
    for (size_t hi = i; hi + 1 < main.size() && free[hi + 1]; ++hi) run += main[hi + 1]->size;
    if (run >= request) return ReleasePath::kFits;
    if (released >= request) return ReleasePath::kReached;
  }
  return ReleasePath::kNever;
}

}  // namespace pymem
