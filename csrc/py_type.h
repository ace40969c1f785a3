// py_type.h — a static CPython type that Python code subclasses (records.Record, records.Recipe).
#pragma once

#include <pybind11/pybind11.h>

namespace pymem {

// What a subclassable, garbage-collected base type with a weakref list needs; the rest of the
// type (members, getters, methods) is the caller's to set before or after.
struct GcTypeSlots {
  const char* name;  // "pymem._C.X"
  const char* doc;
  Py_ssize_t basicsize;
  Py_ssize_t weaklistoffset;
  newfunc new_;
  destructor dealloc;
  traverseproc traverse;
  inquiry clear;
};

// Fills `type` (zero-initialised static storage) with `slots`, readies it, and binds it as m.`attr`.
inline void ready_gc_type(pybind11::module_& m, const char* attr, PyTypeObject& type, const GcTypeSlots& slots) {
  Py_SET_REFCNT(reinterpret_cast<PyObject*>(&type), 1);  // what PyVarObject_HEAD_INIT would set
  type.tp_name = slots.name;
  type.tp_doc = slots.doc;
  type.tp_basicsize = slots.basicsize;
  type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  type.tp_new = slots.new_;
  type.tp_dealloc = slots.dealloc;
  type.tp_traverse = slots.traverse;
  type.tp_clear = slots.clear;
  type.tp_weaklistoffset = slots.weaklistoffset;
  if (PyType_Ready(&type) < 0) throw pybind11::error_already_set();
  Py_INCREF(&type);  // static: never freed
  m.attr(attr) = pybind11::handle(reinterpret_cast<PyObject*>(&type));
}

}  // namespace pymem
