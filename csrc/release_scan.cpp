// release_scan.cpp — the lowest-scoring releasable value (see release_scan.h), and its binding.
#include "release_scan.h"

#include "arena.h"
#include "neighbourhood.h"
#include "recipe.h"
#include "record.h"
#include "step_trace.h"
#include "storage.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace pymem {
namespace {

constexpr int kAncestorWalk = 64;  // records.py: evicted_ancestor_cost looks at most at this many
constexpr int kReaderDepth = 8;    // records.py: next_use follows evicted readers this deep

bool is_none(PyObject* o) { return o == nullptr || o == Py_None; }

class Scorer {
 public:
  explicit Scorer(const ScanInputs& in) : in_(in) {}

  double score(RecordObject* r) { return score(r, nullptr); }

  // Policy.block_cost: from the score, as the formula that gave it says.
  double block_cost(RecordObject* r) {
    const ScoreFormula* f = nullptr;
    const double s = std::max(score(r, &f), 0.0);
    return f->block_per_byte ? s * static_cast<double>(std::max<int64_t>(r->nbytes, 1)) : s;
  }

 private:
  double score(RecordObject* r, const ScoreFormula** used) {
    const ScoreFormula* f = &in_.formula;
    if (used != nullptr) *used = f;
    double d = 0;
    if (f->per & ScoreFormula::kNextUse) {
      d = next_use(r, kReaderDepth);
      if (d < 0) {
        f = &in_.fallback;  // the plan cannot place it
        if (used != nullptr) *used = f;
      } else if (d == std::numeric_limits<double>::infinity()) {
        return 0.0;  // read no more this step: released first, its costs not walked (planned.py)
      }
    }
    return evaluate(*f, r, d);
  }

  double evaluate(const ScoreFormula& f, RecordObject* r, double d) {
    double num = 1.0;
    bool any = false;
    auto add = [&](double x) {
      num = any ? num + x : x;
      any = true;
    };
    if (f.costs & ScoreFormula::kCompute) add(r->compute_cost);
    if (f.costs & ScoreFormula::kNeighbours) add(neighbour_cost(r));
    if (f.costs & ScoreFormula::kAncestors) add(ancestor_cost(r));
    if (f.costs & ScoreFormula::kLastAccess) add(r->last_access);
    double den = 1.0;
    bool some = false;
    auto mul = [&](double x) {
      den = some ? den * x : x;
      some = true;
    };
    if (f.per & ScoreFormula::kBytes) mul(static_cast<double>(std::max<int64_t>(r->nbytes, 1)));
    if (f.per & ScoreFormula::kStaleness) mul(std::max(in_.now - r->last_access, 1e-12));
    if (f.per & ScoreFormula::kNextUse) mul(std::max(d, 1e-12));
    return some ? num / den : num;
  }

  // records.py: Record.evicted_neighbour_cost over Record.neighbour_ids().
  double neighbour_cost(RecordObject* r) {
    if (in_.neighbourhood == nullptr) return 0.0;
    ids_.clear();
    inputs_.clear();
    if (!is_none(r->recipe)) append_input_records(r->recipe, inputs_);
    for (PyObject* p : inputs_) ids_.push_back(reinterpret_cast<RecordObject*>(p)->id);
    for_each_live_child(r, [&](RecordObject* c) { ids_.push_back(c->id); });
    return in_.neighbourhood->neighbour_cost(ids_.data(), ids_.size());
  }

  // records.py: Record.evicted_ancestor_cost (the same walk, in the same order).
  double ancestor_cost(RecordObject* r) {
    double total = 0.0;
    stack_.clear();
    seen_.clear();
    if (!is_none(r->recipe)) append_input_records(r->recipe, stack_);
    while (!stack_.empty() && seen_.size() < kAncestorWalk) {
      RecordObject* a = reinterpret_cast<RecordObject*>(stack_.back());
      stack_.pop_back();
      if (std::find(seen_.begin(), seen_.end(), a->id) != seen_.end() || record_available(a, in_.cache)) continue;
      seen_.push_back(a->id);
      if (!is_none(a->host)) {  // comes back by a copy; its own ancestors are not needed
        total += static_cast<double>(a->nbytes) / in_.link_bandwidth;
        continue;
      }
      total += a->compute_cost;
      if (!is_none(a->recipe)) append_input_records(a->recipe, stack_);
    }
    return total;
  }

  // records.py: _next_use. Negative: the plan cannot say.
  double next_use(RecordObject* r, int depth) {
    double d = in_.plan->seconds_to_next_use(r);
    if (d < 0 || depth == 0) return d;
    for_each_live_child(r, [&](RecordObject* c) {
      if (!c->evicted || !is_none(c->host)) return;
      const double dc = next_use(c, depth - 1);
      if (dc >= 0 && dc < d) d = dc;
    });
    return d;
  }

  const ScanInputs& in_;
  std::vector<int64_t> ids_, seen_;
  std::vector<PyObject*> inputs_, stack_;
};

bool has_recipe(const RecordObject* r) { return !is_none(r->recipe); }

ScoreFormula parse_formula(py::handle costs, py::handle per) {
  ScoreFormula f;
  for (py::handle h : py::reinterpret_borrow<py::iterable>(costs)) {
    const std::string t = py::cast<std::string>(h);
    if (t == "compute_cost") f.costs |= ScoreFormula::kCompute;
    else if (t == "evicted_neighbour_cost") f.costs |= ScoreFormula::kNeighbours;
    else if (t == "evicted_ancestor_cost") f.costs |= ScoreFormula::kAncestors;
    else if (t == "last_access") f.costs |= ScoreFormula::kLastAccess;
    else throw std::invalid_argument("unknown cost term '" + t + "'; accepted: compute_cost, evicted_neighbour_cost, "
                                     "evicted_ancestor_cost, last_access");
  }
  for (py::handle h : py::reinterpret_borrow<py::iterable>(per)) {
    const std::string t = py::cast<std::string>(h);
    if (t == "nbytes") f.per |= ScoreFormula::kBytes;
    else if (t == "staleness") f.per |= ScoreFormula::kStaleness;
    else if (t == "next_use") f.per |= ScoreFormula::kNextUse;
    else throw std::invalid_argument("unknown per term '" + t + "'; accepted: nbytes, staleness, next_use");
  }
  return f;
}

}  // namespace

bool leaf_may_go(py::handle rule, PyObject* record) {
  if (rule.is_none()) return false;
  if (PyFloat_Check(rule.ptr())) {
    auto* r = reinterpret_cast<RecordObject*>(record);
    r->compute_cost = 2.0 * static_cast<double>(r->nbytes) / PyFloat_AS_DOUBLE(rule.ptr());  // out and back
    return true;
  }
  return py::cast<bool>(rule(py::handle(record)));
}

namespace {

// Every release candidate, as lowest_scoring takes them: f(record, nullptr) for each record of
// `table` in memory in the arena and free to go (a leaf only where leaf_ok lets it go, asked before
// the liveness test as the Python loop does, since it sets the leaf's cost), then f(record, entry)
// for each record of the recompute cache with a recipe and no locks or waits (entry: its
// (StorageRef, tensor)).
template <class F>
void for_each_candidate(py::dict table, PyObject* cache, py::handle leaf_ok, F&& f) {
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  const Py_ssize_t size = PyDict_Size(table.ptr());
  while (PyDict_Next(table.ptr(), &pos, &key, &value)) {
    RecordObject* r = as_record(value);
    if (r == nullptr) throw std::logic_error("pymem: the runtime's table holds a value that is no Record");
    if (!unheld_in_arena(r)) continue;
    if (!has_recipe(r)) {
      if (leaf_ok.is_none()) continue;
      py::object held = py::reinterpret_borrow<py::object>(value);
      const bool ok = leaf_may_go(leaf_ok, held.ptr());
      if (PyDict_Size(table.ptr()) != size)
        throw std::runtime_error("pymem: the record table changed size during the release scan");
      if (!ok) continue;
    }
    if (!storage_alive(r)) continue;  // after leaf_ok: Python reading r.sref replaces its reference
    f(value, nullptr);
  }
  pos = 0;
  while (PyDict_Next(cache, &pos, &key, &value)) {
    RecordObject* r = as_record(key);
    if (r == nullptr || !has_recipe(r) || r->locks != 0 || r->waits != 0) continue;
    f(key, value);
  }
}

}  // namespace

py::object lowest_scoring(py::dict table, const ScanInputs& in, py::handle leaf_ok) {
  Scorer scorer(in);
  py::object best;  // owned: Python (leaf_ok) may run between picks
  double best_score = std::numeric_limits<double>::infinity();
  int64_t best_id = 0;
  for_each_candidate(table, in.cache, leaf_ok, [&](PyObject* o, PyObject*) {
    auto* r = reinterpret_cast<RecordObject*>(o);
    const double s = scorer.score(r);
    if (s < best_score || (s == best_score && best && r->id < best_id)) {
      best = py::reinterpret_borrow<py::object>(o);
      best_score = s;
      best_id = r->id;
    }
  });
  return best ? best : py::none();
}

py::list ranked_candidates(py::dict table, const ScanInputs& in, py::handle leaf_ok) {
  struct Ranked {
    double score;
    int64_t id;
    uintptr_t addr;
    py::object record;  // owned: leaf_ok runs Python between candidates
  };
  std::vector<Ranked> out;
  for_each_candidate(table, in.cache, leaf_ok, [&](PyObject* o, PyObject* entry) {
    auto* r = reinterpret_cast<RecordObject*>(o);
    const uintptr_t addr = entry == nullptr ? storage_ref_of(r)->data_ptr()
                                            : py::cast<const StorageRef&>(py::handle(entry)[py::int_(0)]).data_ptr();
    out.push_back({0.0, r->id, addr, py::reinterpret_borrow<py::object>(o)});
  });
  Scorer scorer(in);
  for (Ranked& c : out) c.score = scorer.score(reinterpret_cast<RecordObject*>(c.record.ptr()));
  std::sort(out.begin(), out.end(),
            [](const Ranked& a, const Ranked& b) { return a.score != b.score ? a.score < b.score : a.id < b.id; });
  py::list ranked;
  for (Ranked& c : out) ranked.append(py::make_tuple(c.addr, c.record));
  return ranked;
}

py::dict mark_window_owners(Arena& arena, py::dict table, const ScanInputs& in, py::handle leaf_ok, uintptr_t lo,
                            uintptr_t hi) {
  auto data_ptr = [](const RecordObject* r) -> uintptr_t {
    const StorageRef* s = storage_ref_of(r);
    return s != nullptr ? s->data_ptr() : 0;
  };
  auto leaf_ok_for = [&](PyObject* value) { return leaf_may_go(leaf_ok, value); };
  // Owner 0: a value that must stay (locked, waited on, pinned, a leaf that cannot go).
  std::vector<py::object> table_records;  // owned: leaf_ok runs Python
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(table.ptr(), &pos, &key, &value)) table_records.push_back(py::reinterpret_borrow<py::object>(value));
  for (const py::object& o : table_records) {
    RecordObject* r = as_record(o.ptr());
    if (r == nullptr) throw std::logic_error("pymem: the runtime's table holds a value that is no Record");
    if (!r->in_arena || r->evicted) continue;
    if (r->locks != 0 || r->waits != 0 || r->pins != 0 || (!has_recipe(r) && !leaf_ok_for(o.ptr()))) {
      const uintptr_t addr = data_ptr(r);
      if (addr != 0) arena.set_owner(addr, 0, 0.0);
    }
  }
  std::vector<std::pair<py::object, uintptr_t>> cached;  // (record, address) of the cache
  pos = 0;
  while (PyDict_Next(in.cache, &pos, &key, &value)) {
    RecordObject* r = as_record(key);
    if (r == nullptr) continue;
    const uintptr_t addr = py::cast<const StorageRef&>(PyTuple_GET_ITEM(value, 0)).data_ptr();
    cached.emplace_back(py::reinterpret_borrow<py::object>(key), addr);
    if (r->locks != 0 || r->waits != 0) arena.set_owner(addr, 0, 0.0);
  }
  // The candidates, as lowest_scoring takes them, with their block costs.
  std::vector<std::pair<py::object, uintptr_t>> candidates;
  for (const py::object& o : table_records) {
    RecordObject* r = as_record(o.ptr());
    if (!unheld_in_arena(r) || (!has_recipe(r) && !leaf_ok_for(o.ptr())) || !storage_alive(r)) continue;
    candidates.emplace_back(o, data_ptr(r));
  }
  for (auto& [o, addr] : cached) {
    RecordObject* r = as_record(o.ptr());
    if (has_recipe(r) && r->locks == 0 && r->waits == 0) candidates.emplace_back(o, addr);
  }
  Scorer scorer(in);
  py::dict owners;
  for (auto& [o, addr] : candidates) {
    if (addr == 0 || addr < lo || addr >= hi) continue;
    RecordObject* r = as_record(o.ptr());
    arena.set_owner(addr, static_cast<uint64_t>(r->id), scorer.block_cost(r));
    owners[py::int_(r->id)] = o;
  }
  return owners;
}

py::list score_all(py::handle records, const ScanInputs& in) {
  Scorer scorer(in);
  py::list out;
  for (py::handle h : py::reinterpret_borrow<py::iterable>(records)) {
    RecordObject* r = as_record(h.ptr());
    if (r == nullptr) throw py::type_error("pymem: ReleaseScan.scores takes records");
    out.append(scorer.score(r));
  }
  return out;
}

void bind_release_scan(py::module_& m) {  // bindings.cpp calls it
  struct Scan {
    ScoreFormula formula, fallback;

    ScanInputs inputs(py::dict cache, double now, py::handle plan, py::handle neighbourhood,
                      double link_bandwidth) const {
      ScanInputs in;
      in.now = now;
      in.formula = formula;
      in.fallback = fallback;
      in.plan = as_step_trace(plan);
      if ((formula.per & ScoreFormula::kNextUse) && in.plan == nullptr) in.formula = fallback;
      in.neighbourhood = neighbourhood.is_none() ? nullptr : &neighbourhood.cast<EvictedNeighbourhood&>();
      in.link_bandwidth = link_bandwidth;
      in.cache = cache.ptr();
      return in;
    }
  };
  // A method of the scan over the record table: f(table, the scan's inputs, leaf_ok).
  auto over_table = [](auto f) {
    return [f](const Scan& s, py::dict table, py::dict cache, double now, py::handle plan, py::handle neighbourhood,
               double link_bandwidth, py::handle leaf_ok) {
      return f(table, s.inputs(cache, now, plan, neighbourhood, link_bandwidth), leaf_ok);
    };
  };
  py::class_<Scan>(m, "ReleaseScan",
                   "A policy's score as data, evaluated over the runtime's records (csrc/release_scan.h).")
      .def(py::init([](py::handle costs, py::handle per, py::handle fallback_costs, py::handle fallback_per,
                       bool block_per_byte, bool fallback_block_per_byte) {
             Scan s{parse_formula(costs, per), parse_formula(fallback_costs, fallback_per)};
             s.formula.block_per_byte = block_per_byte;
             s.fallback.block_per_byte = fallback_block_per_byte;
             if ((s.fallback.per & ScoreFormula::kNextUse) ||
                 ((s.formula.per & ScoreFormula::kNextUse) && s.fallback.costs == 0 && s.fallback.per == 0))
               throw std::invalid_argument("a formula that reads next_use needs a fallback that does not");
             return s;
           }),
           py::arg("costs"), py::arg("per"), py::arg("fallback_costs") = py::tuple(),
           py::arg("fallback_per") = py::tuple(), py::arg("block_per_byte") = true,
           py::arg("fallback_block_per_byte") = true)
      .def(
          "lowest", over_table(lowest_scoring), py::arg("table"), py::arg("cache"), py::arg("now"), py::arg("plan"), py::arg("neighbourhood"),
          py::arg("link_bandwidth"), py::arg("leaf_ok"),
          "The record to release now (None: no candidate): see csrc/release_scan.h.")
      .def(
          "scores",
          [](const Scan& s, py::handle records, py::dict cache, double now, py::handle plan, py::handle neighbourhood,
             double link_bandwidth) {
            const ScanInputs in = s.inputs(cache, now, plan, neighbourhood, link_bandwidth);
            return score_all(records, in);
          },
          py::arg("records"), py::arg("cache"), py::arg("now"), py::arg("plan"), py::arg("neighbourhood"),
          py::arg("link_bandwidth"), "The score of each record (a list of floats), as `lowest` scores it.")
      .def(
          "ranked", over_table(ranked_candidates), py::arg("table"), py::arg("cache"), py::arg("now"), py::arg("plan"), py::arg("neighbourhood"),
          py::arg("link_bandwidth"), py::arg("leaf_ok"),
          "Every candidate `lowest` looks at, as [(address, record)], lowest score first (of equal scores the "
          "oldest): the order the pressure handler would release them in.")
      .def(
          "mark_window",
          [](const Scan& s, Arena& arena, py::dict table, py::dict cache, double now, py::handle plan,
             py::handle neighbourhood, double link_bandwidth, py::handle leaf_ok, uintptr_t lo, uintptr_t hi) {
            return mark_window_owners(arena, table, s.inputs(cache, now, plan, neighbourhood, link_bandwidth), leaf_ok,
                                      lo, hi);
          },
          py::arg("arena"), py::arg("table"), py::arg("cache"), py::arg("now"), py::arg("plan"),
          py::arg("neighbourhood"), py::arg("link_bandwidth"), py::arg("leaf_ok"), py::arg("lo"), py::arg("hi"),
          "Coop's window search input: owners and block costs set on the arena; {id: record} of the candidates.");
}

}  // namespace pymem
