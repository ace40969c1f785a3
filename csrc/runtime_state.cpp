// runtime_state.cpp — _C.RuntimeBase and the per-thread runtime state (see runtime_state.h).
#include "runtime_state.h"

#include "py_type.h"

#include <pybind11/pybind11.h>
#include <structmember.h>

#include <cstddef>

namespace py = pybind11;

namespace pymem {
namespace {

int64_t g_last_serial = 0;  // under the GIL
thread_local int64_t t_managed_serial = 0;
thread_local double t_handler_seconds = 0.0;

PyTypeObject g_type{};  // a static type, filled by bind_runtime_state

PyObject* runtime_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* rt = reinterpret_cast<RuntimeObject*>(type->tp_alloc(type, 0));  // zeroed, GC-tracked
  if (rt == nullptr) return nullptr;
  rt->serial = ++g_last_serial;
  return reinterpret_cast<PyObject*>(rt);
}

int runtime_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* rt = reinterpret_cast<RuntimeObject*>(self);
  Py_VISIT(rt->cost_model);
  Py_VISIT(rt->swap);
  return 0;
}

int runtime_clear(PyObject* self) {
  auto* rt = reinterpret_cast<RuntimeObject*>(self);
  Py_CLEAR(rt->cost_model);
  Py_CLEAR(rt->swap);
  return 0;
}

// A subclass's instances come here through subtype_dealloc, which drops the type's reference.
void runtime_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  runtime_clear(self);
  Py_TYPE(self)->tp_free(self);
}

#define PYMEM_MEMBER(name, kind, doc) {#name, kind, offsetof(RuntimeObject, name), 0, doc}
PyMemberDef g_members[] = {
    PYMEM_MEMBER(clock, T_DOUBLE, "the logical clock: seconds of ops (and recomputes) run so far"),
    PYMEM_MEMBER(num_ops, T_LONGLONG, "ops seen"),
    PYMEM_MEMBER(no_recipes, T_LONGLONG, "> 0: ops get no recipes (optimizer steps, pymem.no_recompute)"),
    {"_sweep_at", T_LONGLONG, offsetof(RuntimeObject, sweep_at), 0, "the table size past which it is swept"},
    {"serial", T_LONGLONG, offsetof(RuntimeObject, serial), READONLY, "unique per runtime"},
    PYMEM_MEMBER(active, T_BOOL, "ops are managed (between start and stop)"),
    PYMEM_MEMBER(cost_model, T_OBJECT, "a CostModel estimating op costs, or None: costs are measured"),
    PYMEM_MEMBER(swap, T_OBJECT, "the Swapper (offloading), or None"),
    {nullptr, 0, 0, 0, nullptr},
};
#undef PYMEM_MEMBER

}  // namespace

PyTypeObject* runtime_base_type() { return &g_type; }

bool thread_managed_by(int64_t serial) { return t_managed_serial == serial; }

double handler_seconds() { return t_handler_seconds; }

void bind_runtime_state(py::module_& m) {  // bindings.cpp calls it
  g_type.tp_members = g_members;
  ready_gc_type(m, "RuntimeBase", g_type,
                {"pymem._C.RuntimeBase", "The per-op fields of a Runtime (pymem.runtime.runtime), in C; see csrc/runtime_state.h.",
                 sizeof(RuntimeObject), 0, runtime_new, runtime_dealloc, runtime_traverse, runtime_clear});
  m.def(
      "mark_thread_managed",
      [](py::handle runtime) {
        RuntimeObject* rt = as_runtime(runtime.ptr());
        if (rt == nullptr) throw py::type_error("pymem: mark_thread_managed takes a Runtime");
        t_managed_serial = rt->serial;
      },
      py::arg("runtime"), "The calling thread counts as managed by `runtime` (ThreadCoverage's cache, per thread).");
  m.def("handler_seconds", &handler_seconds, "This thread's seconds in the pressure handler.");
  m.def(
      "add_handler_seconds", [](double seconds) { t_handler_seconds += seconds; }, py::arg("seconds"));
}

}  // namespace pymem
