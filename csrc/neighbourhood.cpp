// neighbourhood.cpp — DTR's evicted neighbourhood (see neighbourhood.h), and its Python binding.
#include "neighbourhood.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace pymem {

int32_t EvictedNeighbourhood::find(int32_t n) {
  int32_t root = n;
  while (parent_[root] != root) root = parent_[root];
  while (parent_[n] != root) {  // path compression
    const int32_t next = parent_[n];
    parent_[n] = root;
    n = next;
  }
  return root;
}

int32_t EvictedNeighbourhood::unite(int32_t a, int32_t b) {
  a = find(a);
  b = find(b);
  if (a == b) return a;
  if (size_[a] < size_[b]) std::swap(a, b);
  parent_[b] = a;
  size_[a] += size_[b];
  cost_[a] += cost_[b];
  return a;
}

void EvictedNeighbourhood::on_evict(int64_t key, double cost, const int64_t* neighbours, size_t count) {
  if (is_evicted(key)) throw std::invalid_argument(std::to_string(key) + " is already evicted");
  if (!(cost >= 0)) throw std::invalid_argument("compute cost must be >= 0, got " + std::to_string(cost));
  int32_t n = static_cast<int32_t>(parent_.size());
  parent_.push_back(n);
  size_.push_back(1);
  cost_.push_back(cost);
  node_.emplace(key, Node{n, cost});
  for (size_t i = 0; i < count; ++i) {
    auto it = node_.find(neighbours[i]);
    if (it != node_.end()) n = unite(n, it->second.index);
  }
}

bool EvictedNeighbourhood::on_rematerialize(int64_t key) {
  auto it = node_.find(key);
  if (it == node_.end()) return false;
  cost_[find(it->second.index)] -= it->second.own;
  node_.erase(it);
  return true;
}

double EvictedNeighbourhood::neighbour_cost(const int64_t* keys, size_t n) {
  roots_.clear();
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) {
    auto it = node_.find(keys[i]);
    if (it == node_.end()) continue;
    const int32_t root = find(it->second.index);
    if (std::find(roots_.begin(), roots_.end(), root) != roots_.end()) continue;  // a handful at most
    roots_.push_back(root);
    total += std::max(cost_[root], 0.0);
  }
  return total;
}

namespace {

std::vector<int64_t> keys_of(py::handle keys) {
  std::vector<int64_t> out;
  for (py::handle k : py::reinterpret_borrow<py::iterable>(keys)) out.push_back(py::cast<int64_t>(k));
  return out;
}

}  // namespace

void bind_neighbourhood(py::module_& m) {  // bindings.cpp calls it
  py::class_<EvictedNeighbourhood>(m, "EvictedNeighbourhood",
                                   "DTR's evicted neighbourhood e*, by union-find (csrc/neighbourhood.h). Keys are ints.")
      .def(py::init<>())
      .def("__len__", &EvictedNeighbourhood::size, "Nodes allocated (evicted keys plus stale nodes).")
      .def("is_evicted", &EvictedNeighbourhood::is_evicted, py::arg("key"))
      .def(
          "on_evict",
          [](EvictedNeighbourhood& nb, int64_t key, double cost, py::handle neighbours) {
            const std::vector<int64_t> ks = keys_of(neighbours);
            nb.on_evict(key, cost, ks.data(), ks.size());
          },
          py::arg("key"), py::arg("cost"), py::arg("neighbours"),
          "`key` (compute cost `cost`) was just evicted; `neighbours`: its graph neighbours' keys (evicted or not).")
      .def(
          "on_rematerialize",
          [](EvictedNeighbourhood& nb, int64_t key) {
            if (!nb.on_rematerialize(key)) throw py::key_error(std::to_string(key) + " is not evicted");
          },
          py::arg("key"), "`key` is resident again: its cost leaves its class; the class is not split.")
      .def(
          "neighbour_cost",
          [](EvictedNeighbourhood& nb, py::handle keys) {
            const std::vector<int64_t> ks = keys_of(keys);
            return nb.neighbour_cost(ks.data(), ks.size());
          },
          py::arg("neighbours"), "e*: the total cost of the distinct evicted classes among `neighbours`.");
}

}  // namespace pymem
