// record.cpp — _C.RecordBase: the C layout of a runtime record (see record.h).
#include "record.h"

#include "py_type.h"
#include "storage.h"

#include <pybind11/pybind11.h>
#include <structmember.h>

#include <cstddef>

namespace pymem {
namespace {

int64_t g_last_id = 0;  // under the GIL

PyTypeObject g_type{};  // a static type, filled by bind_record

// The object fields, in one place: construction, traversal and clearing walk the same list.
template <class F>
void each_object(RecordObject* r, F&& f) {
  f(r->home);
  f(r->sref);
  f(r->recipe);
  f(r->children);
  f(r->lost);
  f(r->op);
  f(r->host);
  f(r->hold);
}

PyObject* record_new(PyTypeObject* type, PyObject*, PyObject*) {
  return reinterpret_cast<PyObject*>(new_record_of(type));
}

int record_traverse(PyObject* self, visitproc visit, void* arg) {
  int out = 0;
  each_object(reinterpret_cast<RecordObject*>(self), [&](PyObject* o) {
    if (out == 0 && o != nullptr) out = visit(o, arg);
  });
  return out;
}

int record_clear(PyObject* self) {
  auto* r = reinterpret_cast<RecordObject*>(self);
  r->sref_value = nullptr;  // first: clearing the fields below may run Python that reads the record
  each_object(r, [](PyObject*& o) { Py_CLEAR(o); });
  StorageRef* native = r->native_sref;
  r->native_sref = nullptr;
  delete native;
  return 0;
}

// `sref`: made from native_sref on first read (record.h).
PyObject* get_sref(PyObject* self, void*) {
  auto* r = reinterpret_cast<RecordObject*>(self);
  if (r->native_sref != nullptr) {
    try {
      PyObject* made = pybind11::cast(*r->native_sref).release().ptr();
      delete r->native_sref;
      r->native_sref = nullptr;
      Py_XSETREF(r->sref, made);
      r->sref_value = &pybind11::handle(made).cast<const StorageRef&>();
    } catch (pybind11::error_already_set& e) {
      e.restore();
      return nullptr;
    }
  }
  PyObject* v = r->sref != nullptr ? r->sref : Py_None;
  Py_INCREF(v);
  return v;
}

int set_sref(PyObject* self, PyObject* value, void*) {
  auto* r = reinterpret_cast<RecordObject*>(self);
  delete r->native_sref;
  r->native_sref = nullptr;
  const StorageRef* found = nullptr;  // anything but a StorageRef (None) leaves the cast to storage_ref_of
  if (value != nullptr && value != Py_None) {
    try {
      found = &pybind11::handle(value).cast<const StorageRef&>();
    } catch (pybind11::cast_error&) {
    }
  }
  Py_XINCREF(value);
  r->sref_value = found;  // before the old value goes: its dealloc may run Python that reads the record
  Py_XSETREF(r->sref, value);
  return 0;
}

// `children`: an empty list made on first read (record.h).
PyObject* get_children(PyObject* self, void*) {
  auto* r = reinterpret_cast<RecordObject*>(self);
  if (r->children == nullptr && (r->children = PyList_New(0)) == nullptr) return nullptr;
  Py_INCREF(r->children);
  return r->children;
}

int set_children(PyObject* self, PyObject* value, void*) {
  auto* r = reinterpret_cast<RecordObject*>(self);
  Py_XINCREF(value);
  Py_XSETREF(r->children, value);
  return 0;
}

PyGetSetDef g_getset[] = {
    {"sref", get_sref, set_sref, "the _C.StorageRef of the storage holding this value, or None", nullptr},
    {"children", get_children, set_children, "weakrefs to the records whose recipes read this value", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

// A subclass's instances come here through subtype_dealloc, which drops the type's reference.
void record_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  if (reinterpret_cast<RecordObject*>(self)->weakrefs != nullptr) PyObject_ClearWeakRefs(self);
  record_clear(self);
  Py_TYPE(self)->tp_free(self);
}

#define PYMEM_MEMBER(name, kind, doc) {#name, kind, offsetof(RecordObject, name), 0, doc}
PyMemberDef g_members[] = {
    {"id", T_LONGLONG, offsetof(RecordObject, id), READONLY, "unique, increasing with creation"},
    PYMEM_MEMBER(nbytes, T_LONGLONG, nullptr),
    PYMEM_MEMBER(locks, T_LONGLONG, nullptr),
    PYMEM_MEMBER(waits, T_LONGLONG, nullptr),
    PYMEM_MEMBER(need_rank, T_LONGLONG, nullptr),
    PYMEM_MEMBER(pins, T_LONGLONG, nullptr),
    PYMEM_MEMBER(depth, T_LONGLONG, nullptr),
    PYMEM_MEMBER(trace_step, T_LONGLONG, "the step trace's step in which trace_value was given (0: none)"),
    PYMEM_MEMBER(trace_value, T_LONGLONG, "the value's index in that step's trace"),
    PYMEM_MEMBER(compute_cost, T_DOUBLE, nullptr),
    PYMEM_MEMBER(last_access, T_DOUBLE, nullptr),
    PYMEM_MEMBER(evicted, T_BOOL, nullptr),
    PYMEM_MEMBER(in_arena, T_BOOL, nullptr),
    PYMEM_MEMBER(address_out, T_BOOL, nullptr),
    PYMEM_MEMBER(home, T_OBJECT, nullptr),
    PYMEM_MEMBER(recipe, T_OBJECT, nullptr),
    PYMEM_MEMBER(lost, T_OBJECT, nullptr),
    PYMEM_MEMBER(op, T_OBJECT, nullptr),
    PYMEM_MEMBER(host, T_OBJECT, nullptr),
    PYMEM_MEMBER(hold, T_OBJECT, nullptr),
    {nullptr, 0, 0, 0, nullptr},
};
#undef PYMEM_MEMBER

}  // namespace

PyObject* children_of(RecordObject* r) {
  if (r->children == nullptr) r->children = PyList_New(0);
  return r->children;
}

RecordObject* new_record_of(PyTypeObject* type) {
  auto* r = reinterpret_cast<RecordObject*>(type->tp_alloc(type, 0));  // zeroed, GC-tracked
  if (r == nullptr) return nullptr;
  r->id = ++g_last_id;
  each_object(r, [](PyObject*& o) {
    Py_INCREF(Py_None);
    o = Py_None;
  });
  Py_CLEAR(r->children);  // made on first use (record.h)
  return r;
}

void set_native_sref(RecordObject* r, const StorageRef& ref) {
  auto* made = new StorageRef(ref);
  delete r->native_sref;
  r->native_sref = made;
  Py_CLEAR(r->sref);
  r->sref_value = nullptr;
}

const StorageRef* storage_ref_of(const RecordObject* r) {
  if (r->native_sref != nullptr) return r->native_sref;
  if (r->sref_value != nullptr) return r->sref_value;
  if (r->sref == nullptr || r->sref == Py_None) return nullptr;
  return &pybind11::handle(r->sref).cast<const StorageRef&>();
}

bool storage_alive(const RecordObject* r) {
  const StorageRef* s = storage_ref_of(r);
  return s != nullptr && s->alive();
}

bool record_available(const RecordObject* r, PyObject* cache) {
  const int in_cache = PyDict_Contains(cache, reinterpret_cast<PyObject*>(const_cast<RecordObject*>(r)));
  if (in_cache < 0) throw pybind11::error_already_set();
  return in_cache != 0 || (!r->evicted && storage_alive(r));
}

PyTypeObject* record_base_type() { return &g_type; }

void bind_record(pybind11::module_& m) {  // bindings.cpp calls it
  g_type.tp_members = g_members;
  g_type.tp_getset = g_getset;
  ready_gc_type(m, "RecordBase", g_type,
                {"pymem._C.RecordBase", "The fields of a runtime Record (pymem.runtime.records), in C; see csrc/record.h.",
                 sizeof(RecordObject), offsetof(RecordObject, weakrefs), record_new, record_dealloc, record_traverse,
                 record_clear});
}

}  // namespace pymem
