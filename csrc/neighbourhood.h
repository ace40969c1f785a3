// neighbourhood.h — DTR's evicted neighbourhood e*(t), approximated with union-find (h_DTR^eq).
//
// Evicted values that are neighbours in the op graph (one produced the other, or one is an input of
// the other's recompute) form classes; each class keeps its members' total compute cost. Releasing
// a resident value t would make a future recompute redo every class t touches, so
//   e*(t) ~= the sum of the costs of the distinct classes among t's evicted neighbours.
// Rematerializing a member does not split its class (what union-find cannot do cheaply); its cost
// is subtracted instead: the DTR paper's approximation. A value evicted again later starts a fresh
// node, so stale nodes only ever link classes, never add cost.
//
// One class serves the runtime (keys: record ids) and the simulator (keys: trace value indices),
// through _C.EvictedNeighbourhood (pymem/policies/neighbourhood.py), and the runtime's release scan
// (release_scan.h) reads it without a Python call.
//
// Invariants: a root's cost_ is its class's total (members' own costs, less those rematerialized);
// node_ holds exactly the keys now evicted; nodes are never freed (the owner rebuilds a fresh one when
// most are stale). Not thread-safe: the runtime's lock (or the GIL) serialises every use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace pymem {

class EvictedNeighbourhood {
 public:
  bool is_evicted(int64_t key) const { return node_.count(key) != 0; }
  // Nodes allocated: the keys now evicted plus the stale nodes of rematerialized ones.
  size_t size() const { return parent_.size(); }

  // `key` (compute cost `cost` >= 0, not evicted now) was just evicted; `neighbours` are its graph
  // neighbours, evicted or not (resident ones are ignored). Throws std::invalid_argument otherwise.
  void on_evict(int64_t key, double cost, const int64_t* neighbours, size_t n);
  // `key` is resident again: its own cost leaves its class. False (nothing done) if it was not evicted.
  bool on_rematerialize(int64_t key);
  // e*: the total cost (each class at least 0) of the distinct classes among `keys` that are
  // evicted, summed in the order their first member appears in `keys`.
  double neighbour_cost(const int64_t* keys, size_t n);

 private:
  int32_t find(int32_t n);
  int32_t unite(int32_t a, int32_t b);

  std::vector<int32_t> parent_;
  std::vector<int32_t> size_;
  std::vector<double> cost_;  // valid at roots
  struct Node {
    int32_t index;
    double own;  // the key's own cost, taken out of its class when it comes back
  };
  std::unordered_map<int64_t, Node> node_;  // evicted key -> its current node
  std::vector<int32_t> roots_;             // neighbour_cost's scratch (distinct roots seen)
};

}  // namespace pymem
