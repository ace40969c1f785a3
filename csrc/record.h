// record.h — the layout of a runtime record (one value of one alias pool), in C.
//
// pymem/runtime/records.py's Record subclasses _C.RecordBase and adds only methods (the TensorView
// properties policies read). Every field lives here, as a member of a C struct, so the fast path
// (fast_op.cpp) makes a record and updates its locks, clock and depth by writing fields, with no
// attribute lookup and no Python frame; Python reads and writes the same fields through member
// descriptors under the same names. What each field means is documented once, in records.py.
//
// Invariants:
//  - Touched under the GIL only (the runtime's bookkeeping holds it; so does the fast path).
//  - Object fields are never NULL after construction but may be cleared by the garbage collector
//    (tp_clear) or deleted from Python; a cleared field reads as None.
//  - `id` is unique per process and increases with creation: the sweep orders records by it.
//  - `sref` is made lazily: a record the fast path makes holds its storage reference as a C++
//    StorageRef (`native_sref`) and makes the Python _C.StorageRef only when Python first reads
//    `sref` (most records are never read from Python). At most one of the two is set.
//  - `children` is NULL until something is linked to the record or Python reads it: NULL reads as
//    an empty list (most values are read by no recipe, or only after the sweep dropped them).
#pragma once

#include <Python.h>

#include <cstdint>

namespace pymem {

class StorageRef;  // storage.h

struct RecordObject {
  PyObject_HEAD
  PyObject* weakrefs;  // the list CPython keeps for weakref.ref(record)
  int64_t id;
  int64_t nbytes;
  int64_t locks;
  int64_t waits;
  int64_t need_rank;
  int64_t pins;
  int64_t depth;
  int64_t trace_step;   // the step trace's step in which trace_value was given (step_trace.h); 0: none
  int64_t trace_value;  // the value's index in that step
  double compute_cost;
  double last_access;
  char evicted;  // char: what a T_BOOL member reads and writes
  char in_arena;
  char address_out;
  PyObject* home;
  PyObject* sref;           // a _C.StorageRef or None; NULL while native_sref stands for it
  StorageRef* native_sref;  // owned
  // The C++ value inside `sref` (borrowed: `sref` holds it), found once where `sref` is set, so that
  // C++ reads of it skip pybind11's cast (a type-map lookup: 260 ns of the sweep's 300 a record).
  const StorageRef* sref_value;
  PyObject* recipe;
  PyObject* children;  // a list of weakrefs to the records whose recipes read this value; NULL: empty
  PyObject* lost;
  PyObject* op;
  PyObject* host;
  PyObject* hold;
};

// _C.RecordBase, ready once the module is bound (bind_record in bindings.cpp).
PyTypeObject* record_base_type();

// A new record of `type` (RecordBase or a subclass), every field at its default: None, 0, False,
// no `children` list yet, the next id. New reference; NULL with a Python error set on failure.
RecordObject* new_record_of(PyTypeObject* type);

// r's `children` list, made if it has none. Borrowed; NULL with a Python error set on failure.
PyObject* children_of(RecordObject* r);

// Gives `r` its storage reference as a C++ object (the Python one is made on first read).
void set_native_sref(RecordObject* r, const StorageRef& ref);
// The record's storage reference, either form; null when it has none (sref is None).
const StorageRef* storage_ref_of(const RecordObject* r);

// Whether the record's storage is alive (its StorageRef, either form, not expired).
bool storage_alive(const RecordObject* r);
// Residency.is_available: in `cache` (the runtime's recompute cache, a dict keyed by record) or
// its value in its own live storage. Throws pybind11::error_already_set if the lookup fails.
bool record_available(const RecordObject* r, PyObject* cache);

// In the arena, not released, and held by nothing that forbids releasing it (a running op's lock,
// a pending recompute's wait, a pin): what every release candidate is (pressure.py's _candidates).
inline bool unheld_in_arena(const RecordObject* r) {
  return r->in_arena && !r->evicted && r->locks == 0 && r->waits == 0 && r->pins == 0;
}

// f(child) for each live record among r's children: borrowed, alive while the caller holds the
// GIL and runs no Python that could drop them.
template <class F>
void for_each_live_child(const RecordObject* r, F&& f) {
  if (r->children == nullptr || !PyList_Check(r->children)) return;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(r->children); ++i) {
    PyObject* c = PyWeakref_GetObject(PyList_GET_ITEM(r->children, i));
    if (c != Py_None) f(reinterpret_cast<RecordObject*>(c));
  }
}

inline RecordObject* as_record(PyObject* o) {
  return PyObject_TypeCheck(o, record_base_type()) ? reinterpret_cast<RecordObject*>(o) : nullptr;
}

}  // namespace pymem
