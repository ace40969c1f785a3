// fast_op.cpp — Runtime.run_op's common case in C++ (see fast_op.h). Every step below names the
// lines of runtime.py it mirrors; the two must change together (tests/test_interception.py trains under both and compares).
#include "fast_op.h"

#include "allocator_install.h"
#include "arena.h"
#include "intercept.h"
#include "py_errors.h"
#include "recipe.h"
#include "record.h"
#include "runtime_lock.h"
#include "runtime_state.h"
#include "step_trace.h"
#include "storage.h"
#include "types.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <c10/core/GradMode.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace pymem {
namespace {

// Attribute names, interned once: a lookup by an interned name hits the type's attribute cache
// (a C string makes a fresh str per call, which never does).
struct Names {
#define PYMEM_NAME(n) py::object n = py::reinterpret_steal<py::object>(PyUnicode_InternFromString(#n));
  PYMEM_NAME(after_op) PYMEM_NAME(in_flight) PYMEM_NAME(offloaded) PYMEM_NAME(planned) PYMEM_NAME(out_flight)
#undef PYMEM_NAME
};
Names* N = nullptr;  // made by the first set_fast_path, under the GIL; never freed

// The runtime's objects the fast path drives, fetched once per enable (strong references; all
// touched under the GIL only).
struct RuntimeRefs {
  py::object rt, table, running, lock;
  RuntimeObject* state = nullptr;  // rt's C fields (runtime_state.h); rt keeps it
  LockObject* mutex = nullptr;     // rt.lock (runtime_lock.h); `lock` keeps it
  py::object sweep, op_info, graph_task_id, plan_due;
  py::object trace_owner;      // rt.trace
  StepTrace* trace = nullptr;  // trace_owner's
  py::object cost_model_type, op_flops, flop_formula;  // cost_model.py's CostModel, op_flops, _flop_formula
  // The rates of the CostModel last seen as rt.cost_model (read once per model object).
  py::object rates_of;
  double flop_rate = 0, byte_rate = 0, launch = 0;
  py::object view_cost_of;  // the CostModel subclass view_cost_under read last, and its answer
  double view_cost = 0;
  uintptr_t releasable_lo = 0, releasable_hi = 0;  // the backend's releasable_range
  py::object arena_owner;     // the backend's arena (None: the native allocator)
  Arena* arena = nullptr;     // arena_owner's, which measures each kernel's temporaries
  PyTypeObject* recipe_type = nullptr;  // records.Recipe
  PyTypeObject* record_type = nullptr;  // records.Record
  py::object home;  // rt.residency, every record's
  py::object set_eval_frame;  // Dynamo's, or None (see _Mode in runtime.py)
  py::object leaf_name;
  c10::DeviceType device = c10::DeviceType::CPU;
  int64_t depth_limit = 0;
};
RuntimeRefs* g_rt = nullptr;
FastPathStats g_stats;

// Runs `call`, which enters pymem's Python, with Dynamo's frame callback off: a torch.compile'd
// caller's callback must not trace pymem's frames (as _run in interception.py). Only around such
// calls: the common case runs no Python frame, and pays nothing for this.
template <class F>
decltype(auto) in_python(const RuntimeRefs& R, F&& call) {
  struct Restore {
    const RuntimeRefs& R;
    py::object prior;
    ~Restore() {
      try {
        R.set_eval_frame(prior);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("pymem: restoring Dynamo's frame callback");
      }
    }
  } restore{R, R.set_eval_frame(py::none())};
  return call();
}

// A copy to or from host memory is pending (swap.after_op has work: swap.py's queues, copies in flight).
bool swap_busy(const RuntimeObject& S) {
  if (S.swap == nullptr || S.swap == Py_None) return false;
  py::handle swap(S.swap);
  return PyObject_IsTrue(swap.attr(N->offloaded).ptr()) == 1 || PyObject_IsTrue(swap.attr(N->planned).ptr()) == 1 ||
         PyObject_IsTrue(swap.attr(N->in_flight).ptr()) == 1 || PyObject_IsTrue(swap.attr(N->out_flight).ptr()) == 1;
}

// What run_op reads of an op (ops.py's OpInfo), per schema, computed once.
struct OpFacts {
  bool eligible = false;
  bool pure = false;        // its outputs may get recipes
  bool overwrites = false;  // writes every element of its one written argument without reading it
  bool fresh_returns = false;
  bool priced = false;      // torch's FLOP counter has a formula for it (cost_model._flop_formula)
  int32_t code = 0;         // its op code in step traces (step_trace.h)
  std::vector<size_t> mutated;  // schema positions of the arguments it writes (OpInfo.mutated)
  py::object func;  // the OpOverload
  py::object name;  // str(func), a record's `op`
};
std::unordered_map<const void*, OpFacts>* g_facts = nullptr;  // GIL-guarded; lives as long as the process

const OpFacts& facts_of(const RuntimeRefs& R, const c10::OperatorHandle& op) {
  if (g_facts == nullptr) g_facts = new std::unordered_map<const void*, OpFacts>();
  const void* key = &op.schema();
  auto it = g_facts->find(key);
  if (it != g_facts->end()) return it->second;
  OpFacts f;
  f.func = py::reinterpret_borrow<py::object>(torch::detail::getTorchApiFunction(op));
  in_python(R, [&] {
    py::object info = R.op_info(f.func);
    f.eligible = py::len(info.attr("regrown")) == 0 && !info.attr("seeded").cast<bool>() &&
                 !info.attr("collective").cast<bool>();
    f.pure = info.attr("pure").cast<bool>();
    f.overwrites = info.attr("overwrites").cast<bool>();
    for (py::handle m : info.attr("mutated")) f.mutated.push_back(m.cast<py::tuple>()[0].cast<size_t>());
    f.fresh_returns = info.attr("fresh_returns").cast<bool>();
    f.name = info.attr("name");
    f.code = info.attr("code").cast<int32_t>();
    f.priced = !R.flop_formula(f.func.attr("overloadpacket")).is_none();
  });
  return g_facts->emplace(key, std::move(f)).first->second;
}

uintptr_t key_of(const at::Tensor& t) {  // _C.storage_key
  if (!t.defined() || !t.has_storage()) return 0;
  return reinterpret_cast<uintptr_t>(t.storage().unsafeGetStorageImpl());
}

// _gather: tensor arguments in order, one level of lists.
void gather(const c10::IValue& v, c10::SmallVectorImpl<at::Tensor>& out) {
  any_tensor_arg(v, [&](const at::Tensor& t) {
    out.push_back(t);
    return false;
  });
}

// Runtime._leaf_hold: the tensor through which recipes keep leaf `r`'s storage, one for all of them.
py::object leaf_hold(RecordObject* r) {
  if (r->hold != nullptr && r->hold != Py_None) {
    PyObject* h = PyWeakref_GetObject(r->hold);  // borrowed; None once dead
    if (h == nullptr) throw py::error_already_set();
    if (h != Py_None) return py::reinterpret_borrow<py::object>(h);
  }
  const StorageRef* ref = storage_ref_of(r);
  if (ref == nullptr) throw std::logic_error("pymem: a leaf input's record has no storage reference");
  py::object h = py::reinterpret_steal<py::object>(THPVariable_Wrap(ref->strong()));
  if (!h) throw py::error_already_set();
  PyObject* w = PyWeakref_NewRef(h.ptr(), nullptr);
  if (w == nullptr) throw py::error_already_set();
  Py_XSETREF(r->hold, w);
  return h;
}

// Runtime._refs for an input `t` (record `r`) that the op does not write: what ArgRef(r, None, t,
// False) or, for a leaf, ArgRef(None, Runtime._leaf_hold(r), t, False) holds.
CapturedRef input_ref(RecordObject* r, const at::Tensor& t) {
  CapturedRef c;
  if (r->recipe == Py_None)
    c.leaf = leaf_hold(r);
  else
    c.rec = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(r));
  c.dtype = t.scalar_type();
  c.size.assign(t.sizes().begin(), t.sizes().end());
  c.stride.assign(t.strides().begin(), t.strides().end());
  c.offset = t.storage_offset();
  c.conj = t.is_conj();
  c.neg = t.is_neg();
  return c;
}

double now_seconds() {  // time.perf_counter's clock (CLOCK_MONOTONIC)
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The kernel's failure was a refused allocation (torch.OutOfMemoryError or c10's).
bool refused(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::OutOfMemoryError&) {
    return true;
  } catch (py::error_already_set& err) {
    return err.matches(py::module_::import("torch").attr("OutOfMemoryError"));
  } catch (...) {
    return false;
  }
}

// The refusal as the Python exception run_op would have caught.
py::object refusal_object(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (py::error_already_set& err) {
    return err.value();
  } catch (const ArenaRefusal& err) {
    take_last_refusal();  // given here with its figures; Python must not take it again later
    return out_of_budget_error(err.cause());
  } catch (const c10::OutOfMemoryError& err) {
    return py::module_::import("torch").attr("OutOfMemoryError")(err.what_without_backtrace());
  }
}

// _unlist
void unlist(const py::object& running, const py::object& entry) {
  PyObject* list = running.ptr();
  for (Py_ssize_t i = PyList_GET_SIZE(list) - 1; i >= 0; --i) {
    if (PyList_GET_ITEM(list, i) == entry.ptr()) {
      PyList_SetSlice(list, i, i + 1, nullptr);
      return;
    }
  }
}

void add_locks(c10::ArrayRef<RecordObject*> recs, int64_t delta) {
  for (RecordObject* r : recs)
    if (r != nullptr) r->locks += delta;
}

// Runtime._new_record: a record for `t`'s storage (key `key`), entered in the table; the table is
// swept when it outgrows the runtime's mark, as there. Borrowed: the table holds it.
RecordObject* new_record(const RuntimeRefs& R, const at::Tensor& t, const py::int_& key, double cost, double now,
                         const py::object& recipe, const py::object& op) {
  StorageRef ref(t);
  const size_t nbytes = ref.nbytes();
  const uintptr_t ptr = ref.data_ptr();
  // ArenaBackend/NativeBackend.releasable: over one grain, in the range the backend may release.
  const bool in_arena = nbytes > kAlignment && R.releasable_lo <= ptr && ptr < R.releasable_hi;
  auto* r = new_record_of(R.record_type);
  if (r == nullptr) throw py::error_already_set();
  py::object owner = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(r));
  Py_SETREF(r->home, R.home.inc_ref().ptr());
  set_native_sref(r, ref);
  Py_SETREF(r->recipe, py::object(recipe).release().ptr());
  Py_SETREF(r->op, py::object(op).release().ptr());
  r->nbytes = static_cast<int64_t>(nbytes);
  r->compute_cost = cost;
  r->last_access = now;
  r->in_arena = in_arena;
  if (PyDict_SetItem(R.table.ptr(), key.ptr(), owner.ptr()) < 0) throw py::error_already_set();
  if (static_cast<int64_t>(PyDict_GET_SIZE(R.table.ptr())) > R.state->sweep_at) in_python(R, [&] { R.sweep(); });
  return r;
}

// Runtime._link: `child` becomes a child of every distinct input record, leaves included (one
// weakref shared by all the lists).
void link(c10::ArrayRef<RecordObject*> recs, RecordObject* child) {
  py::object w = py::reinterpret_steal<py::object>(PyWeakref_NewRef(reinterpret_cast<PyObject*>(child), nullptr));
  if (!w) throw py::error_already_set();
  for (size_t j = 0; j < recs.size(); ++j) {
    RecordObject* r = recs[j];
    if (r == nullptr || std::find(recs.begin(), recs.begin() + j, r) != recs.begin() + j) continue;
    PyObject* children = children_of(r);
    if (children == nullptr || PyList_Append(children, w.ptr()) < 0) throw py::error_already_set();
  }
}

// rt.cost_model is a CostModel whose `seconds` this file computes as it does (not a subclass):
// its rates, read once per model object, are in R.
bool estimate_here(RuntimeRefs& R, PyObject* model) {
  if (Py_TYPE(model) != reinterpret_cast<PyTypeObject*>(R.cost_model_type.ptr())) return false;
  if (R.rates_of.ptr() != model) {
    py::handle m(model);
    R.flop_rate = m.attr("flop_rate").cast<double>();
    R.byte_rate = m.attr("byte_rate").cast<double>();
    R.launch = m.attr("launch").cast<double>();
    R.rates_of = py::reinterpret_borrow<py::object>(model);
  }
  return true;
}

// A view-only op under a CostModel subclass, whose `seconds` only the Python path runs: the model's
// launch cost, a constant as a view's estimate is. Not its measured time: the clock it advances
// ages every value, and timings would make two runs of one program decide differently.
double view_cost_under(RuntimeRefs& R, PyObject* model) {
  if (R.view_cost_of.ptr() != model) {
    PyObject* launch = PyObject_GetAttrString(model, "launch");
    const double v = launch != nullptr ? PyFloat_AsDouble(launch) : 0.0;
    Py_XDECREF(launch);
    if (PyErr_Occurred()) PyErr_Clear();  // a subclass that set no launch: none
    R.view_cost = v > 0 ? v : 0.0;
    R.view_cost_of = py::reinterpret_borrow<py::object>(model);
  }
  return R.view_cost;
}

int64_t viewed_bytes(const at::Tensor& t) {  // cost_model.tensor_bytes of one tensor
  return t.numel() * static_cast<int64_t>(t.element_size());
}

int64_t viewed_bytes(const c10::IValue& v) {  // the same of an op's result (None: 0)
  return v.isTensor() && v.toTensor().defined() ? viewed_bytes(v.toTensor()) : 0;
}

// CostModel.seconds(func, args, kwargs, ins, out): launch + max(flops / flop_rate, bytes / byte_rate),
// in the same double arithmetic. `args`: the op's arguments as the kernel got them; `returns` its
// results on the stack. FLOPs come from torch's formulas (Python, memoized there) for the ops that
// have one (matmuls, convolutions, attention); every other op is priced by bytes alone.
double estimated_cost(const RuntimeRefs& R, const OpFacts& f, const c10::FunctionSchema& schema,
                      c10::ArrayRef<at::Tensor> ins, c10::ArrayRef<c10::IValue> args,
                      c10::ArrayRef<c10::IValue> returns) {
  int64_t moved = 0;
  for (const at::Tensor& t : ins) moved += viewed_bytes(t);
  // `out` as Python sees it: one tensor, or a list or tuple whose tensor items count (one level).
  if (returns.size() == 1 && (returns[0].isTensorList() || returns[0].isList())) {
    for (const c10::IValue& x : returns[0].toListRef()) moved += viewed_bytes(x);
  } else {
    for (const c10::IValue& v : returns) moved += viewed_bytes(v);
  }
  int64_t flops = 0;
  if (f.priced) {
    flops = in_python(R, [&] {
      auto [pargs, pkwargs] = python_call_arguments(schema, [&](size_t i) { return torch::jit::toPyObject(args[i]); });
      py::object out;
      if (returns.size() == 1) {
        out = torch::jit::toPyObject(returns[0]);
      } else {
        py::tuple outs(returns.size());
        for (size_t i = 0; i < returns.size(); ++i) outs[i] = torch::jit::toPyObject(returns[i]);
        out = std::move(outs);
      }
      return R.op_flops(f.func, pargs, pkwargs, out).cast<int64_t>();
    });
  }
  return R.launch + std::max(static_cast<double>(flops) / R.flop_rate, static_cast<double>(moved) / R.byte_rate);
}

}  // namespace

void set_fast_path(py::object runtime) {
  delete g_rt;
  g_rt = nullptr;
  if (runtime.is_none()) return;
  if (N == nullptr) N = new Names();
  auto* R = new RuntimeRefs();
  R->rt = runtime;
  R->table = runtime.attr("table");
  R->running = runtime.attr("running");
  R->state = as_runtime(runtime.ptr());
  R->lock = runtime.attr("lock");
  R->mutex = as_lock(R->lock.ptr());
  if (R->state == nullptr || R->mutex == nullptr) {
    delete R;
    throw py::type_error("pymem: set_fast_path takes a Runtime (a _C.RuntimeBase whose lock is a _C.RuntimeLock)");
  }
  R->sweep = runtime.attr("sweep");
  R->plan_due = runtime.attr("plan_due");
  R->trace_owner = runtime.attr("trace");
  R->trace = as_step_trace(R->trace_owner);
  std::tie(R->releasable_lo, R->releasable_hi) =
      runtime.attr("backend").attr("releasable_range").cast<std::pair<uintptr_t, uintptr_t>>();
  R->arena_owner = runtime.attr("backend").attr("arena");
  if (!R->arena_owner.is_none()) R->arena = R->arena_owner.cast<Arena*>();
  R->home = runtime.attr("residency");
  py::module_ records = py::module_::import("pymem.runtime.records");
  py::module_ runtime_mod = py::module_::import("pymem.runtime.runtime");
  R->record_type = reinterpret_cast<PyTypeObject*>(records.attr("Record").ptr());  // the module keeps it
  R->recipe_type = reinterpret_cast<PyTypeObject*>(records.attr("Recipe").ptr());
  R->op_info = py::module_::import("pymem.runtime.ops").attr("op_info");
  R->graph_task_id = py::module_::import("torch").attr("_C").attr("_current_graph_task_id");
  R->set_eval_frame = py::module_::import("pymem.runtime.interception").attr("_set_eval_frame");
  R->depth_limit = runtime_mod.attr("_DEPTH_LIMIT").cast<int64_t>();
  py::module_ cost_model = py::module_::import("pymem.cost_model");
  R->cost_model_type = cost_model.attr("CostModel");
  R->op_flops = cost_model.attr("op_flops");
  R->flop_formula = cost_model.attr("_flop_formula");
  R->device = c10::Device(py::str(runtime.attr("device")).cast<std::string>()).type();
  R->leaf_name = py::str("leaf");
  g_rt = R;
}

FastPathStats fast_path_stats() { return g_stats; }

bool run_fast_op(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack) {
  if (g_rt == nullptr) return false;
  RuntimeRefs& R = *g_rt;
  RuntimeObject& S = *R.state;
  const OpFacts& f = facts_of(R, op);
  // Cases the Python path owns (run_op): not active; costs estimated by a cost model other than
  // cost_model.CostModel itself (a subclass's `seconds`); a thread seen for the first time
  // (threads.seen); a seeded op, a collective, an op that may grow a storage (resize_).
  // A view-only op (every output aliases an input) takes this path under any cost model: its cost
  // is then its measured time (a view's estimate is as near zero). It must: torch's own C++ makes
  // views that Python then adopts (Tensor._make_subclass, under nn.Parameter, detaches its data and
  // gives the new tensor a Parameter object), and the Python path would already have given that
  // tensor a plain Tensor object.
  const bool view_only = !f.fresh_returns && f.mutated.empty();
  const bool estimated = S.cost_model != nullptr && S.cost_model != Py_None;
  const bool estimate_here_ok = estimated && estimate_here(R, S.cost_model);
  if (!f.eligible || !S.active || (estimated && !estimate_here_ok && !view_only) || !thread_managed_by(S.serial)) {
    ++g_stats.slow;
    return false;
  }
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  // Small vectors throughout: an op has a few tensors, and a malloc per vector per op showed in
  // profiles of tiny ops.
  c10::SmallVector<at::Tensor, 6> ins;
  for (const c10::IValue& v : torch::jit::last(*stack, n)) gather(v, ins);

  lock_acquire(R.mutex);
  struct Unlock {
    LockObject* mutex;
    bool held = true;
    ~Unlock() {
      if (held && !lock_release(mutex)) PyErr_WriteUnraisable(nullptr);
    }
  } unlock{R.mutex};

  // run_op: inputs to records (a leaf record for a storage seen for the first time). `recs` holds
  // them (the list `running` shows compaction); `rs` the same records, or null where `recs` has None.
  py::list recs(ins.size());
  c10::SmallVector<RecordObject*, 6> rs(ins.size(), nullptr);
  for (size_t j = 0; j < ins.size(); ++j) recs[j] = py::none();
  bool managed = true;
  for (size_t j = 0; j < ins.size(); ++j) {
    const at::Tensor& t = ins[j];
    if (!is_managed_tensor(t, R.device)) {
      managed = false;
      continue;  // recs[j] stays None
    }
    const uintptr_t key = key_of(t);
    py::int_ pykey(key);
    PyObject* found = PyDict_GetItemWithError(R.table.ptr(), pykey.ptr());
    if (found == nullptr && PyErr_Occurred()) throw py::error_already_set();
    RecordObject* r;
    if (found != nullptr) {
      r = as_record(found);
      if (r == nullptr) throw std::logic_error("pymem: the runtime's table holds a value that is no Record");
    } else if (key == 0) {
      managed = false;
      continue;
    } else {
      r = new_record(R, t, pykey, 0.0, S.clock, py::none(), R.leaf_name);
    }
    if (r->evicted) {  // a restore: the Python path's
      ++g_stats.slow;
      return false;
    }
    recs[j] = py::handle(reinterpret_cast<PyObject*>(r));
    rs[j] = r;
  }
  bool recomputable = managed && f.pure && S.no_recipes == 0 &&
                            (c10::GradMode::is_enabled() || (R.graph_task_id().cast<long>() < 0 && !f.overwrites));
  if (!f.mutated.empty()) {
    // run_op's in-place cases but one go to Python: a recipe for the written value (the record
    // splits), a snapshot of a written leaf for a fresh output's recipe, or a write to a leaf some
    // recipe read (its dependents are invalidated). What stays is a write to leaves no recipe reads
    // whose outputs get no recipe (a gradient summed in place in backward, zero_ on gradients, any
    // write under no_recompute): their host copies go stale, nothing else changes.
    if (recomputable && f.fresh_returns) {
      ++g_stats.slow;
      return false;
    }
    c10::SmallVector<const c10::TensorImpl*, 2> written;
    for (size_t pos : f.mutated)
      if (pos < n)
        any_tensor_arg(torch::jit::last(*stack, n)[pos], [&](const at::Tensor& t) {
          written.push_back(t.unsafeGetTensorImpl());
          return false;
        });
    c10::SmallVector<RecordObject*, 2> overwritten;
    for (size_t j = 0; j < ins.size(); ++j) {
      RecordObject* r = rs[j];
      if (r == nullptr || std::find(written.begin(), written.end(), ins[j].unsafeGetTensorImpl()) == written.end())
        continue;
      const bool read = r->children != nullptr && (!PyList_Check(r->children) || PyList_GET_SIZE(r->children) != 0);
      if (r->recipe != Py_None || read) {
        ++g_stats.slow;
        return false;
      }
      overwritten.push_back(r);
    }
    if (!overwritten.empty() && swap_busy(S)) {  // a copy out ahead still reading one: run_op waits for it
      py::object out_flight = py::handle(S.swap).attr(N->out_flight);
      for (RecordObject* r : overwritten) {
        const int in = PySequence_Contains(out_flight.ptr(), reinterpret_cast<PyObject*>(r));
        if (in < 0) throw py::error_already_set();
        if (in == 1) {
          ++g_stats.slow;
          return false;
        }
      }
    }
    for (RecordObject* r : overwritten) {
      Py_INCREF(Py_None);
      Py_XSETREF(r->host, Py_None);  // overwritten in place below: a host copy would be stale
    }
    // Every written value is a leaf, and no snapshot is taken (no fresh output): run_op's
    // recomputable ends false here.
    recomputable = false;
  }
  add_locks(rs, +1);
  struct UnlockInputs {
    const RuntimeRefs& R;
    py::list& recs;
    c10::SmallVectorImpl<RecordObject*>& rs;
    bool held = true;
    ~UnlockInputs() {
      if (!held) return;
      try {
        unlist(R.running, recs);
        add_locks(rs, -1);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("pymem: unlocking an op's inputs");
      }
    }
  } unlock_inputs{R, recs, rs};
  PyList_Append(R.running.ptr(), recs.ptr());
  const double handled = handler_seconds();
  const size_t base = stack->size() - n;
  const c10::SmallVector<c10::IValue, 8> saved(torch::jit::last(*stack, n).begin(), torch::jit::last(*stack, n).end());

  // The kernel, with the runtime's lock and the GIL released (Runtime._kernel).
  if (!lock_release(R.mutex)) throw py::error_already_set();
  unlock.held = false;
  const std::optional<Arena::OpMark> mark = R.arena != nullptr ? std::optional(R.arena->mark_op()) : std::nullopt;
  const double t0 = now_seconds();
  const uint64_t refusals = arena_refusals_here();
  std::exception_ptr failure;
  {
    py::gil_scoped_release no_gil;
    try {
      op.redispatchBoxed(below, stack);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  const double t1 = now_seconds();
  const size_t transient = mark ? R.arena->transient_since(*mark) : 0;
  lock_acquire(R.mutex);
  unlock.held = true;
  if (failure) {
    unlock_inputs.held = false;
    unlist(R.running, recs);
    add_locks(rs, -1);
    if (!refused(failure)) std::rethrow_exception(failure);
    if (!f.pure || !f.mutated.empty()) {  // it may have written before it ran out: no retry (run_op)
      py::object error = in_python(R, [&] { return R.rt.attr("_run_error")(f.name, recs, refusal_object(failure)); });
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
      throw py::error_already_set();
    }
    // A functional op that ran out leaves no trace: give the Python path its arguments back.
    stack->resize(base);  // whatever the kernel left
    stack->insert(stack->end(), saved.begin(), saved.end());
    ++g_stats.slow;
    return false;
  }
  if (arena_refusals_here() != refusals)  // it went on with less memory (runtime/fallbacks.py)
    in_python(R, [&] { R.rt.attr("fallbacks").attr("note")(f.name); });
  const double cost = estimate_here_ok ? estimated_cost(R, f, schema, ins, saved, torch::jit::last(*stack, schema.returns().size()))
                     : estimated          ? view_cost_under(R, S.cost_model)
                                          : (t1 - t0) - (handler_seconds() - handled);
  unlock_inputs.held = false;
  unlist(R.running, recs);
  add_locks(rs, -1);

  ++S.num_ops;
  const double now = S.clock + cost;
  S.clock = now;
  for (RecordObject* r : rs)
    if (r != nullptr) r->last_access = now;

  // The recipe the outputs share (run_op: refs, targs, tkw), captured in C++ (recipe.h).
  std::optional<Capture> capture;
  int64_t depth = 1;
  if (recomputable && f.fresh_returns) {
    for (RecordObject* r : rs)
      if (r->recipe != Py_None) depth = std::max(depth, r->depth + 1);  // recomputable: every input has a record
    if (depth <= R.depth_limit) {
      capture = capture_arguments(f.func, schema, saved);
      capture->refs.reserve(ins.size());
      for (size_t j = 0; j < ins.size(); ++j) capture->refs.push_back(input_ref(rs[j], ins[j]));
    }
  }

  // Outputs: a known storage (a view) is touched; a fresh one gets a record (and the recipe).
  const size_t num_returns = schema.returns().size();
  // One tensor returned (most ops): its recipe takes the capture itself; several share copies.
  const bool one_output = num_returns == 1 && stack->back().isTensor();
  size_t index = 0;
  c10::SmallVector<RecordObject*, 2> made;  // fresh values, for the step trace
  auto output = [&](const at::Tensor& o) {
    const size_t i = index++;
    if (!is_managed_tensor(o, R.device)) return;
    const uintptr_t key = key_of(o);
    if (key == 0) return;
    py::int_ pykey(key);
    PyObject* found = PyDict_GetItemWithError(R.table.ptr(), pykey.ptr());
    if (found == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (found != nullptr) {
      RecordObject* r = as_record(found);
      if (r == nullptr) throw std::logic_error("pymem: the runtime's table holds a value that is no Record");
      r->last_access = now;
      return;
    }
    py::object recipe = !capture  ? py::none()
                        : one_output ? new_captured_recipe(R.recipe_type, std::move(*capture), static_cast<int64_t>(i))
                                     : new_captured_recipe(R.recipe_type, *capture, static_cast<int64_t>(i));
    RecordObject* created = new_record(R, o, pykey, cost, now, recipe, f.name);
    created->depth = depth;
    made.push_back(created);
    if (!recipe.is_none()) link(rs, created);
  };
  for (const c10::IValue& v : torch::jit::last(*stack, num_returns)) {
    if (v.isTensor()) {
      output(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& o : v.toTensorList().vec()) output(o);
    } else if (v.isList()) {
      for (const c10::IValue& x : v.toListRef()) {
        if (x.isTensor()) output(x.toTensor());
        else ++index;
      }
    } else {
      ++index;
    }
  }
  if (R.trace != nullptr && R.trace->record_op(f.code, cost, static_cast<int64_t>(transient), rs, made))
    in_python(R, [&] { R.plan_due(); });  // the step plan releases, or copies out ahead, after this op
  // Last: the op is booked, so the plan's position (the prefetch's in-trigger) is the next op's.
  if (swap_busy(S))  // the kernel's pressure, or the plan, offloaded something
    in_python(R, [&] { py::handle(S.swap).attr(N->after_op)(); });
  ++g_stats.fast;
  return true;
}

}  // namespace pymem
