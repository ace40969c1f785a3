// step_trace.cpp — the step trace's arrays (see step_trace.h).
#include "step_trace.h"

#include "plan_cover.h"
#include "recipe.h"
#include "record.h"
#include "storage.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <unordered_map>

namespace py = pybind11;

namespace pymem {
namespace {

struct OpCodes {
  std::unordered_map<std::string, int32_t> code;
  std::vector<std::string> name;
};
OpCodes& op_codes() {  // under the GIL
  static auto* codes = new OpCodes();  // never freed: codes live as long as the process
  return *codes;
}

template <class T>
py::array_t<T> as_array(const std::vector<T>& v) {
  return py::array_t<T>(static_cast<py::ssize_t>(v.size()), v.data());  // a copy
}

// A step given from outside (cover_releases, learned_releases, comeback_cost): its arrays must index each other.
void check_step(const StepArrays& s) {
  const size_t n = s.op.size(), m = s.value_bytes.size();
  const auto bad = [](const std::string& what) { throw py::value_error("pymem: bad step arrays: " + what); };
  if (s.op_cost.size() != n || s.inputs_start.size() != n + 1 || s.outputs_start.size() != n + 1)
    bad("op_cost needs one entry per op, inputs_start and outputs_start one more");
  if (!s.op_transient.empty() && s.op_transient.size() != n)
    bad("op_transient, when given, needs one entry per op");
  if (!std::all_of(s.op_transient.begin(), s.op_transient.end(), [](int64_t b) { return b >= 0 && b < (int64_t{1} << 48); }))
    bad("op_transient must be between 0 and 2**48");
  if (s.value_producer.size() != m || s.value_recomputable.size() != m)
    bad("value_producer and value_recomputable need one entry per value (value_bytes)");
  if (!s.value_free_at.empty() && s.value_free_at.size() != m)
    bad("value_free_at, when given, needs one entry per value (value_bytes)");
  if (!s.value_overwrites.empty() && s.value_overwrites.size() != m)
    bad("value_overwrites, when given, needs one entry per value (value_bytes)");
  for (int32_t w : s.value_overwrites)
    if (w < -1 || (w >= 0 && static_cast<size_t>(w) >= m)) bad("value_overwrites must be a value index or -1");
  if (!s.value_blank_rerun.empty() && s.value_blank_rerun.size() != m)
    bad("value_blank_rerun, when given, needs one entry per value (value_bytes)");
  for (size_t v = 0; v < s.value_blank_rerun.size(); ++v)
    if (s.value_blank_rerun[v] > 1 || (s.value_blank_rerun[v] == 1 && (s.value_overwrites.size() != m || s.value_overwrites[v] < 0)))
      bad("value_blank_rerun must be 0 or 1, and 1 only where value_overwrites names the value overwritten");
  for (size_t v = 0; v < s.value_free_at.size(); ++v) {
    const int32_t f = s.value_free_at[v];
    if (f < -1 || (f >= 0 && static_cast<size_t>(f) >= n)) bad("value_free_at must be an op position or -1");
  }
  const auto starts_ok = [](const std::vector<int64_t>& start, size_t len) {
    if (start.front() != 0 || static_cast<size_t>(start.back()) != len) return false;
    return std::is_sorted(start.begin(), start.end());
  };
  if (!starts_ok(s.inputs_start, s.inputs.size()) || !starts_ok(s.outputs_start, s.outputs.size()))
    bad("inputs_start / outputs_start must rise from 0 to the length of inputs / outputs");
  const auto in_range = [&](int32_t v) { return v >= 0 && static_cast<size_t>(v) < m; };
  if (!std::all_of(s.inputs.begin(), s.inputs.end(), in_range) || !std::all_of(s.outputs.begin(), s.outputs.end(), in_range))
    bad("inputs and outputs must be value indices (0 .. len(value_bytes) - 1)");
  for (int32_t p : s.value_producer)
    if (p < -1 || (p >= 0 && static_cast<size_t>(p) >= n)) bad("value_producer must be an op position or -1");
  if (!std::all_of(s.value_bytes.begin(), s.value_bytes.end(), [](int64_t b) { return b >= 0 && b < (int64_t{1} << 48); }))
    bad("value_bytes must be between 0 and 2**48");
  if (!std::all_of(s.op_cost.begin(), s.op_cost.end(), [](double c) { return std::isfinite(c) && c >= 0; }))
    bad("op_cost must be finite and not negative");
}

template <class T>
void get_key(py::dict d, const char* key, T& out) {
  if (!d.contains(key)) throw py::key_error(std::string("pymem: the step has no '") + key + "' (see last_step())");
  try {
    out = py::cast<T>(d[key]);
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("pymem: step['") + key + "'] must be a sequence of " +
                         (std::string(key) == "op_cost" ? "floats" : "integers") + " in the range of its type");
  }
}

// A step given as a dict (last_step()'s keys), checked.
StepArrays step_from_dict(py::dict d) {
  StepArrays s;
  get_key(d, "op", s.op);
  get_key(d, "op_cost", s.op_cost);
  if (d.contains("op_transient")) get_key(d, "op_transient", s.op_transient);
  get_key(d, "inputs_start", s.inputs_start);
  get_key(d, "inputs", s.inputs);
  get_key(d, "outputs_start", s.outputs_start);
  get_key(d, "outputs", s.outputs);
  get_key(d, "value_bytes", s.value_bytes);
  get_key(d, "value_producer", s.value_producer);
  get_key(d, "value_recomputable", s.value_recomputable);
  if (d.contains("value_free_at")) get_key(d, "value_free_at", s.value_free_at);
  if (d.contains("value_overwrites")) get_key(d, "value_overwrites", s.value_overwrites);
  if (d.contains("value_blank_rerun")) get_key(d, "value_blank_rerun", s.value_blank_rerun);
  check_step(s);
  return s;
}

// A step's comebacks (and its releases, with `releases`) from the dict into `s`. Entries naming
// no value of the step are skipped where they are read (comeback_cost, StepPlan::learned).
void events_from_dict(py::dict d, StepArrays& s, bool releases) {
  get_key(d, "back_at", s.back_at);
  get_key(d, "back_value", s.back_value);
  if (releases) {
    get_key(d, "released_at", s.released_at);
    get_key(d, "released_value", s.released_value);
  }
  if (s.back_at.size() != s.back_value.size() || s.released_at.size() != s.released_value.size())
    throw py::value_error("pymem: bad step arrays: back_at and back_value (released_at and released_value) "
                          "need one entry each per event");
}

constexpr const char* kReleasesNames[] = {"learned", "cover", "rebuild", "belady", "greedy"};  // by StepPlan::Releases

StepPlan::Releases releases_arg(const std::string& how) {
  for (int w = 0; w < PlanChoice::kWays; ++w)
    if (how == kReleasesNames[w]) return static_cast<StepPlan::Releases>(w);
  throw py::value_error("pymem: a step is planned 'learned', 'cover', 'rebuild', 'belady' or 'greedy', got '" + how +
                        "'");
}

const char* releases_name(StepPlan::Releases how) { return kReleasesNames[static_cast<int>(how)]; }

py::dict as_dict(const StepArrays& s) {
  py::dict d;
  d["op"] = as_array(s.op);
  d["op_cost"] = as_array(s.op_cost);
  if (!s.op_transient.empty()) d["op_transient"] = as_array(s.op_transient);
  d["inputs_start"] = as_array(s.inputs_start);
  d["inputs"] = as_array(s.inputs);
  d["outputs_start"] = as_array(s.outputs_start);
  d["outputs"] = as_array(s.outputs);
  d["value_bytes"] = as_array(s.value_bytes);
  d["value_producer"] = as_array(s.value_producer);
  d["value_recomputable"] = as_array(s.value_recomputable);
  if (!s.value_free_at.empty()) d["value_free_at"] = as_array(s.value_free_at);
  if (!s.value_overwrites.empty()) d["value_overwrites"] = as_array(s.value_overwrites);
  if (!s.value_blank_rerun.empty()) d["value_blank_rerun"] = as_array(s.value_blank_rerun);
  d["released_at"] = as_array(s.released_at);
  d["released_value"] = as_array(s.released_value);
  d["back_at"] = as_array(s.back_at);
  d["back_value"] = as_array(s.back_value);
  return d;
}

// Whether a rerun of what made `made` reads `input`'s value: its recipe lists it (a blank, an input
// the op overwrote whole without reading it, is no record of the recipe). No recipe: no rerun.
bool reads_record(const RecordObject* made, const RecordObject* input) {
  if (made->recipe == nullptr || made->recipe == Py_None) return true;
  std::vector<PyObject*> read;
  append_input_records(made->recipe, read);
  return std::find(read.begin(), read.end(), reinterpret_cast<const PyObject*>(input)) != read.end();
}

}  // namespace

int32_t op_code(const std::string& name) {
  OpCodes& c = op_codes();
  auto it = c.code.find(name);
  if (it != c.code.end()) return it->second;
  const auto code = static_cast<int32_t>(c.name.size());
  c.name.push_back(name);
  c.code.emplace(name, code);
  return code;
}

const std::string& op_name(int32_t code) {
  const OpCodes& c = op_codes();
  if (code < 0 || static_cast<size_t>(code) >= c.name.size()) throw py::index_error("pymem: no op has code " + std::to_string(code));
  return c.name[static_cast<size_t>(code)];
}

int32_t StepTrace::value_of(RecordObject* r) {
  if (r->trace_step == step()) return static_cast<int32_t>(r->trace_value);
  return new_value(r, -1);
}

int32_t StepTrace::new_value(RecordObject* r, int32_t producer) {
  StepArrays& s = current_;
  const auto v = static_cast<int32_t>(s.value_bytes.size());
  s.value_bytes.push_back(r->nbytes);
  s.value_producer.push_back(producer);
  s.value_recomputable.push_back(r->recipe != nullptr && r->recipe != Py_None);
  r->trace_step = step();
  r->trace_value = v;
  if (deaths_whole_) {
    const StorageRef* storage = storage_ref_of(r);
    value_storage_.push_back(storage != nullptr ? std::optional<StorageRef>(*storage) : std::nullopt);
    free_at_.push_back(-1);
    s.value_overwrites.push_back(-1);
    s.value_blank_rerun.push_back(0);
  }
  if (following_ && static_cast<size_t>(v) < offloaded_.size() && offloaded_[static_cast<size_t>(v)] != 0)
    ahead_.emplace_back(py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(r)),
                        offloaded_at_[static_cast<size_t>(v)]);
  if (following_ && plan_.released_early(v)) {  // the plan releases it early: find it then
    PyObject* w = PyWeakref_NewRef(reinterpret_cast<PyObject*>(r), nullptr);
    if (w == nullptr) throw py::error_already_set();
    watched_[v] = py::reinterpret_steal<py::object>(w);
  }
  return v;
}

bool StepTrace::record_op(int32_t code, double cost, int64_t transient, c10::ArrayRef<RecordObject*> inputs,
                          c10::ArrayRef<RecordObject*> made) {
  if (current_.op.size() >= kMaxStepOps) {  // no step mark for this long: a trace of no use
    current_ = StepArrays();
    ++num_dropped_;
    watched_.clear();
    following_ = false;
    deaths_whole_ = false;
    held_.clear();
    value_storage_.clear();
  }
  StepArrays& s = current_;
  const auto k = static_cast<int32_t>(s.op.size());
  ahead_.clear();  // taken after the op before, or of no use now
  for (RecordObject* r : inputs)
    if (r != nullptr) s.inputs.push_back(value_of(r));
  for (RecordObject* r : made) {
    s.outputs.push_back(new_value(r, k));
    if (!deaths_whole_) continue;
    const RecordObject* over = overwritten(r, inputs);
    if (over == nullptr) continue;
    const auto w = static_cast<int32_t>(over->trace_value);
    s.value_overwrites.back() = w;
    s.value_blank_rerun.back() = !reads_record(r, over);
    if (value_storage_[static_cast<size_t>(w)]) {  // its bytes are r's now
      free_at_[static_cast<size_t>(w)] = std::max(k - 1, s.value_producer[static_cast<size_t>(w)]);
      value_storage_[static_cast<size_t>(w)].reset();
    }
  }
  s.op.push_back(code);
  s.op_cost.push_back(cost);
  s.op_transient.push_back(transient);
  s.inputs_start.push_back(static_cast<int64_t>(s.inputs.size()));
  s.outputs_start.push_back(static_cast<int64_t>(s.outputs.size()));
  if (following_ && !plan_.matches(s, static_cast<size_t>(k))) {
    following_ = false;
    ++num_divergences_;
  }
  if (!following_) {
    deaths_whole_ = false;
    held_.clear();  // a plan not followed holds nothing
    return false;
  }
  if (deaths_whole_) {
    watch_deaths(k);
    hold(k);
  }
  const auto [first, last] = plan_.due_after(static_cast<size_t>(k));
  due_.assign(first, last);
  return !due_.empty() || !ahead_.empty();
}

const RecordObject* StepTrace::overwritten(const RecordObject* made, c10::ArrayRef<RecordObject*> inputs) const {
  // The runtime hands an overwritten input's storage to the record of what the op wrote there
  // (run_op: the old record keeps no storage), before the op is booked.
  for (RecordObject* r : inputs)
    if (r != nullptr && r != made && storage_ref_of(r) == nullptr && r->nbytes == made->nbytes &&
        r->trace_step == step() && r->trace_value >= 0)
      return r;
  return nullptr;
}

void StepTrace::watch_deaths(int32_t k) {
  const StepArrays& s = current_;
  // Alive when op k - 1 was booked, gone now: it died after op k - 1 or during op k. The earlier
  // is taken (a plan then counts its bytes one op short at most, never more).
  for (size_t i = 0; i < dying_.size();) {
    auto& storage = value_storage_[static_cast<size_t>(dying_[i])];
    const size_t holders = held_.count(dying_[i]);  // the plan's hold is not the program's
    if (storage && storage->alive() && storage->use_count() > holders) {
      ++i;
      continue;
    }
    if (storage) {  // else noted already (an in-place write over it), or never watchable (no storage)
      const auto v = static_cast<size_t>(dying_[i]);
      free_at_[v] = std::max(k - 1, s.value_producer[v]);
      storage.reset();
    }
    dying_[i] = dying_.back();
    dying_.pop_back();
  }
  // Watched from here: the values op k read or made that the plan reads no more (made before the
  // step: not watched, they count for the whole step).
  const auto watch_if_done = [&](int32_t v) {
    if (s.value_producer[static_cast<size_t>(v)] >= 0 &&
        plan_.next_use_at(v, static_cast<size_t>(k) + 1) == static_cast<int64_t>(plan_.size()))
      dying_.push_back(v);
  };
  for (int64_t i = s.inputs_start[static_cast<size_t>(k)]; i < s.inputs_start[static_cast<size_t>(k) + 1]; ++i)
    watch_if_done(s.inputs[static_cast<size_t>(i)]);
  for (int64_t i = s.outputs_start[static_cast<size_t>(k)]; i < s.outputs_start[static_cast<size_t>(k) + 1]; ++i)
    watch_if_done(s.outputs[static_cast<size_t>(i)]);
}

void StepTrace::hold(int32_t k) {
  for (auto [v, end] = plan_.let_go_after(static_cast<size_t>(k)); v != end; ++v) held_.erase(*v);
  for (auto [v, end] = plan_.holds_after(static_cast<size_t>(k)); v != end; ++v) {
    if (static_cast<size_t>(*v) >= value_storage_.size()) continue;  // not seen in this step
    const auto& storage = value_storage_[static_cast<size_t>(*v)];  // watched: deaths_whole_
    if (storage && storage->alive() && !storage->evicted()) {
      held_.emplace(*v, storage->strong());
      ++num_retained_;
    }
  }
}

void StepTrace::note_offload(const RecordObject* r) {
  if (!planning_ || r->trace_step <= 0 || r->trace_step + 1 < step() || r->trace_value < 0) return;
  const auto v = static_cast<size_t>(r->trace_value);
  if (v >= offloaded_.size()) {
    offloaded_.resize(v + 1, 0);
    offloaded_at_.resize(v + 1, 0);
  }
  offloaded_[v] |= 1;
  offloaded_at_[v] = static_cast<int32_t>(current_.op.size());
}

py::list StepTrace::take_ahead() {
  py::list out;
  for (auto& [r, at] : ahead_) out.append(py::make_tuple(std::move(r), at));
  ahead_.clear();
  return out;
}

void StepTrace::note(const RecordObject* r, std::vector<int32_t>& at, std::vector<int32_t>& value) {
  if (!planning_ || r->trace_step != step()) return;
  at.push_back(static_cast<int32_t>(current_.op.size()));
  value.push_back(static_cast<int32_t>(r->trace_value));
}

py::list StepTrace::take_due() {
  py::list out;
  for (int32_t v : due_) {
    auto it = watched_.find(v);
    if (held_.count(v) != 0) continue;  // held for a rerun: the program freed it (a dead value is not released early)
    if (it == watched_.end()) continue;
    // Kept watched: a plan may release a value again after a rerun brought it back (a cover's
    // stretches, rebuild's "released again right after"). Erased here, only its first went.
    PyObject* r = PyWeakref_GetObject(it->second.ptr());  // borrowed; None once dead
    if (r != nullptr && r != Py_None) out.append(py::handle(r));
  }
  due_.clear();
  return out;
}

void StepTrace::end_step(double moved_seconds) {
  held_.clear();  // a hold ends with its step
  if (deaths_whole_ && current_.op.size() == plan_.size())  // the plan followed whole: every value watched
    current_.value_free_at = std::move(free_at_);
  else {
    current_.value_overwrites.clear();
    current_.value_blank_rerun.clear();
  }
  last_ = std::move(current_);
  current_ = StepArrays();
  ++num_steps_;
  watched_.clear();
  due_.clear();
  ahead_.clear();
  for (uint8_t& bits : offloaded_) bits = static_cast<uint8_t>((bits & 1) << 1);  // this step's become the last's
  if (planning_) plan_next(moved_seconds);
  following_ = planning_ && !plan_.empty();
  planned_step_ = following_;
  value_storage_.clear();
  free_at_.clear();
  dying_.clear();
  deaths_whole_ = following_;
}

void StepTrace::plan_next(double moved_seconds) {
  using R = StepPlan::Releases;
  const bool followed = planned_step_ && following_ && last_.op.size() == plan_.size();  // the whole step ran the plan
  const R ran = plan_.releases();
  if (followed) {
    choice_.measured(ran, comeback_cost(last_), moved_seconds);
    if (StepPlan::covers(ran)) ++num_cover_steps_;
  } else {  // a new program (or the first step): nothing measured holds
    choice_.reset();
    cover_fresh_[0] = cover_fresh_[1] = false;
  }
  if (!followed || ran == R::kLearned) {  // what kLearned learns from: the greedy's, or its own
    learned_from_.released_at = last_.released_at;
    learned_from_.released_value = last_.released_value;
    learned_from_.back_at = last_.back_at;
    learned_from_.back_value = last_.back_value;
  }
  const R how = choice_.next(budget_ > 0);
  const int c = how == R::kRebuild ? 1 : 0;
  if (StepPlan::covers(how) && !cover_fresh_[c]) {
    cover_[c] = how == R::kRebuild ? rebuild_releases(last_, budget_) : cover_releases(last_, budget_);
    cover_fresh_[c] = true;
  }
  plan_.build(last_, how, learned_from_, cover_[c],
              StepPlan::retained(last_, retain_limit_, followed ? plan_.holds() : std::vector<StepPlan::Hold>()));
}

void StepTrace::set_budget(int64_t bytes) {
  if (bytes == budget_) return;
  budget_ = bytes;  // what was measured and covered was for another budget
  choice_.reset();
  cover_fresh_[0] = cover_fresh_[1] = false;
}

void StepTrace::set_planning(bool on) {
  planning_ = on;
  if (!on) {
    plan_ = StepPlan();
    following_ = false;
    deaths_whole_ = false;
    held_.clear();
    value_storage_.clear();
  }
}

double StepTrace::seconds_to_next_use(const RecordObject* r) const {
  if (!guided() || r->trace_step != step()) return -1.0;
  return plan_.seconds_to_next_use(static_cast<int32_t>(r->trace_value), current_.op.size());
}

int64_t StepTrace::next_use_at(const RecordObject* r) const {
  if (!guided() || r->trace_step != step()) return -1;
  return plan_.next_use_at(static_cast<int32_t>(r->trace_value), current_.op.size());
}

double StepTrace::planned_seconds_before(int64_t position) const {
  if (!guided()) return -1.0;
  return plan_.seconds_before(position < 0 ? current_.op.size() : static_cast<size_t>(position));
}

StepTrace* as_step_trace(py::handle o) {
  if (o.is_none()) return nullptr;
  return &o.cast<StepTrace&>();
}

std::vector<RecordObject*> records_of(py::handle seq) {  // None items stay null
  std::vector<RecordObject*> out;
  for (py::handle item : seq) {
    if (item.is_none()) {
      out.push_back(nullptr);
      continue;
    }
    RecordObject* r = as_record(item.ptr());
    if (r == nullptr) throw py::type_error("pymem: StepTrace.record takes Records (or None)");
    out.push_back(r);
  }
  return out;
}

const RecordObject* record_arg(py::handle o, const char* method) {
  const RecordObject* r = as_record(o.ptr());
  if (r == nullptr) throw py::type_error(std::string("pymem: StepTrace.") + method + " takes a Record");
  return r;
}

void bind_step_trace(py::module_& m) {  // bindings.cpp calls it
  py::class_<StepTrace>(m, "StepTrace", "The ops and values of each training step, as arrays (csrc/step_trace.h).")
      .def(py::init<>())
      .def(
          "record",
          [](StepTrace& t, int32_t code, double cost, py::handle inputs, py::handle made, int64_t transient) {
            if (transient < 0) throw py::value_error("pymem: an op's transient bytes cannot be negative, got " + std::to_string(transient));
            return t.record_op(code, cost, transient, records_of(inputs), records_of(made));
          },
          py::arg("code"), py::arg("cost"), py::arg("inputs"), py::arg("made"), py::arg("transient") = 0,
          "One op execution: its code (op_code), cost, input records (None: unmanaged), the records it made and its "
          "kernel's temporaries in bytes (Arena.transient_since). "
          "True when the plan has work due after it: releases (take_due), copies out ahead (take_ahead).")
      .def(
          "note_release", [](StepTrace& t, py::handle r) { t.note_release(record_arg(r, "note_release")); },
          py::arg("record"), "While planning: the record's value leaves memory now.")
      .def(
          "note_back", [](StepTrace& t, py::handle r) { t.note_back(record_arg(r, "note_back")); }, py::arg("record"),
          "While planning: the record's value is back in memory now.")
      .def("let_go", &StepTrace::let_go,
           "Let every value held past the program's free of it go now (csrc/step_plan.h): the runtime stops.")
      .def("take_due", &StepTrace::take_due, "The live records of the values the plan releases after the op just booked.")
      .def(
          "note_offload", [](StepTrace& t, py::handle r) { t.note_offload(record_arg(r, "note_offload")); },
          py::arg("record"), "Offloading: the record's value goes to host memory now (its copy starts ahead from now on).")
      .def("take_ahead", &StepTrace::take_ahead,
           "(record, step position of its last offload) for each record given an index by the op just booked whose "
           "value was offloaded in this step or the one before.")
      .def("end_step", &StepTrace::end_step, py::arg("moved_seconds") = 0.0,
           "The current step is complete; it spent `moved_seconds` moving blocks (compactions), which the "
           "choice of how to plan counts with its comebacks.")
      .def_property_readonly("num_steps", &StepTrace::num_steps)
      .def_property_readonly("num_dropped", &StepTrace::num_dropped)
      .def_property("planning", &StepTrace::planning, &StepTrace::set_planning,
                    "Whether each step is planned from the one before (csrc/step_plan.h).")
      .def_property_readonly("following", &StepTrace::following, "The step so far is its plan's.")
      .def_property_readonly("num_divergences", &StepTrace::num_divergences, "Steps that left their plan.")
      .def_property_readonly("num_cover_steps", &StepTrace::num_cover_steps, "Steps that followed a cover plan whole.")
      .def_property_readonly("num_retained", &StepTrace::num_retained,
                             "Values held past the program's free of them for a rerun that reads them (csrc/step_plan.h).")
      .def_property(
          "retain_limit", &StepTrace::retain_limit,
          [](StepTrace& t, int64_t bytes) {
            if (bytes < 0) throw py::value_error("pymem: retain_limit is a number of bytes (0: hold none), got " + std::to_string(bytes));
            t.set_retain_limit(bytes);
          },
          "The largest value a plan holds past the program's free of it, in bytes (0: none).")
      .def_property("budget", &StepTrace::budget, &StepTrace::set_budget,
                    "Bytes the step's values may occupy, for plans that cover it (0: none).")
      .def_property_readonly(
          "plan_releases",
          [](const StepTrace& t) -> py::object {
            if (!t.following()) return py::none();
            return py::str(releases_name(t.plan_releases()));
          },
          "How the step being followed was planned (csrc/plan_choice.h): 'learned' (early releases learned from "
          "the runtime's), 'cover' or 'rebuild' (the cheapest cover of where the step overflows its budget, its "
          "comebacks priced with their lineage, or with what their reruns rebuild), 'belady' (next uses only), "
          "'greedy' (the policy alone); None when not following a plan.")
      .def_property_readonly("guided", &StepTrace::guided,
                             "Following a plan whose next uses guide releases (any way but 'greedy').")
      .def_property_readonly("covering", &StepTrace::covering,
                             "Following a cover's plan ('cover' or 'rebuild'): its early releases priced the "
                             "recomputes of their evicted readers.")
      .def(
          "seconds_to_next_use",
          [](const StepTrace& t, py::handle record) -> py::object {
            const double s = t.seconds_to_next_use(record_arg(record, "seconds_to_next_use"));
            return s < 0 ? py::object(py::none()) : py::object(py::float_(s));
          },
          py::arg("record"),
          "Planned seconds until the record's value is next read in this step (inf: not again); None: unknown.")
      .def(
          "next_use_at",
          [](const StepTrace& t, py::handle record) -> py::object {
            const int64_t q = t.next_use_at(record_arg(record, "next_use_at"));
            if (q < 0) return py::none();
            if (q >= t.planned_ops()) return py::float_(std::numeric_limits<double>::infinity());
            return py::int_(q);
          },
          py::arg("record"),
          "The step position of the op that next reads the record's value (inf: none in this step); None: unknown.")
      .def(
          "planned_seconds_before",
          [](const StepTrace& t, int64_t position) -> py::object {
            const double s = t.planned_seconds_before(position);
            return s < 0 ? py::object(py::none()) : py::object(py::float_(s));
          },
          py::arg("position") = -1,
          "Planned seconds of the ops before `position` in this step (default: the op running or next); None: not "
          "following a plan.")
      .def("last_step", [](const StepTrace& t) { return as_dict(t.last()); },
           "The last complete step's arrays (copies; see csrc/step_trace.h for their meaning).");
  m.def(
      "cover_releases",
      [](py::dict step, int64_t budget) { return cover_releases(step_from_dict(step), budget); },
      py::arg("step"), py::arg("budget"),
      "The releases csrc/plan_cover.h picks for a step (a dict as last_step() gives) under `budget` bytes: "
      "(position, value) pairs, the value released right after the op at that position. Each comeback is priced "
      "with the lineage it reruns.");
  m.def(
      "rebuild_releases",
      [](py::dict step, int64_t budget) { return rebuild_releases(step_from_dict(step), budget); },
      py::arg("step"), py::arg("budget"),
      "As cover_releases, planning what each rerun rebuilds: kept where it fits until it is due, else released again "
      "right after the rerun (a release at a position that does not read the value).");
  m.def(
      "learned_releases",
      [](py::dict step, py::dict learned_from) {
        const StepArrays s = step_from_dict(step);
        StepArrays from;
        events_from_dict(learned_from, from, true);
        StepPlan plan;
        plan.build(s, StepPlan::Releases::kLearned, from, {});
        std::vector<std::pair<int32_t, int32_t>> due;
        for (size_t k = 0; k < plan.size(); ++k)
          for (auto [v, end] = plan.due_after(k); v != end; ++v) due.emplace_back(static_cast<int32_t>(k), *v);
        return due;
      },
      py::arg("step"), py::arg("learned_from"),
      "The releases a learned plan (csrc/step_plan.h) makes in a step like `step`, learned from the releases and "
      "comebacks of `learned_from` (a dict with released_at, released_value, back_at, back_value): (position, "
      "value) pairs, as cover_releases gives.");
  m.attr("RETAIN_SHARE") = StepPlan::kRetainShare;
  m.def(
      "retained_values",
      [](py::dict step, int64_t retain_limit, const std::vector<std::tuple<int32_t, int32_t, int32_t>>& before) {
        StepArrays s = step_from_dict(step);
        events_from_dict(step, s, true);
        std::vector<StepPlan::Hold> held;
        for (const auto& [v, from, until] : before) held.push_back({v, from, until});
        std::vector<std::tuple<int32_t, int32_t, int32_t>> out;
        for (const StepPlan::Hold& h : StepPlan::retained(s, retain_limit, held)) out.emplace_back(h.value, h.from, h.until);
        return out;
      },
      py::arg("step"), py::arg("retain_limit"), py::arg("before") = std::vector<std::tuple<int32_t, int32_t, int32_t>>(),
      "The values a plan for a step like `step` (a dict with its deaths, value_free_at and value_overwrites, and its "
      "events, released_at, released_value, back_at, back_value) holds past the program's free of them "
      "(csrc/step_plan.h): (value, the op after which it is held, the op after which it is let go) triples. "
      "`before`: the holds `step` ran with, in the same form.");
  m.def(
      "comeback_cost",
      [](py::dict step) {
        StepArrays s = step_from_dict(step);
        events_from_dict(step, s, false);
        return comeback_cost(s);
      },
      py::arg("step"),
      "Seconds of bringing values back in a step with its comebacks (back_at, back_value): each at its producer's "
      "op_cost. What the step plan measures each way of planning by.");
  py::class_<PlanChoice>(m, "PlanChoice",
                         "How the step trace chooses to plan each step (csrc/plan_choice.h): 'learned', 'cover', "
                         "'rebuild', 'belady' or 'greedy'.")
      .def(py::init<>())
      .def_property_readonly_static("TRIAL_STEPS", [](py::object) { return PlanChoice::kTrialSteps; },
                                    "Steps the ways are tried, in turn, before the first choice.")
      .def("reset", &PlanChoice::reset, "Forget what was measured (a new program, or another budget).")
      .def(
          "measured",
          [](PlanChoice& c, const std::string& ran, double cost, double moves) { c.measured(releases_arg(ran), cost, moves); },
          py::arg("ran"), py::arg("cost"), py::arg("moves") = 0.0,
          "A step that followed a `ran` plan whole cost `cost` seconds of memory work bringing values back and "
          "`moves` seconds moving blocks.")
      .def(
          "next",
          [](PlanChoice& c, bool cover_allowed) { return releases_name(c.next(cover_allowed)); },
          py::arg("cover_allowed"),
          "The way to plan the next step: 'learned', 'cover', 'rebuild', 'belady' or 'greedy' ('learned' only where "
          "nothing may be covered).");
  m.def("op_code", &op_code, py::arg("name"), "The process-wide code of an op (its str(OpOverload)).");
  m.def("op_name", &op_name, py::arg("code"));
}

}  // namespace pymem
