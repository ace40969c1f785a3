// sweep.cpp — Runtime.sweep's scan of the record table (see sweep.h).
#include "sweep.h"

#include "record.h"
#include "storage.h"

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <stdexcept>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace pymem {
namespace {

RecordObject* record_of(PyObject* value) {
  RecordObject* r = as_record(value);
  if (r == nullptr) throw std::logic_error("pymem: the runtime's table holds a value that is no Record");
  return r;
}

bool has_live_child(const RecordObject* r) {
  if (r->children == nullptr || !PyList_Check(r->children)) return false;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(r->children); ++i)
    if (PyWeakref_GetObject(PyList_GET_ITEM(r->children, i)) != Py_None) return true;
  return false;
}

// The list without its dead weakrefs (a leaf read every step, the batch, collects them).
void prune_children(RecordObject* r) {
  py::list live;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(r->children); ++i) {
    PyObject* w = PyList_GET_ITEM(r->children, i);
    if (PyWeakref_GetObject(w) != Py_None) live.append(w);
  }
  Py_SETREF(r->children, live.release().ptr());
}

// remat.release_orphaned_leaf's walk, without its effects: whether dropping the recipes that read
// `leaf` would cost no recompute (no dependent evicted, waited on or cached) and pin no more bytes
// than the leaf frees. A no here is that function's no; a yes, Python walks again and acts.
bool orphan_release_may_pay(const RecordObject* leaf, PyObject* cache) {
  int64_t room = leaf->nbytes;
  std::unordered_set<int64_t> seen;  // a batch may have many readers: no linear search
  std::vector<const RecordObject*> stack;
  auto push_children = [&](const RecordObject* r) {
    for_each_live_child(r, [&](const RecordObject* c) { stack.push_back(c); });
  };
  push_children(leaf);
  while (!stack.empty()) {
    const RecordObject* r = stack.back();
    stack.pop_back();
    if (!seen.insert(r->id).second) continue;
    if (r->recipe != nullptr && r->recipe != Py_None) {
      const int in_cache = PyDict_Contains(cache, reinterpret_cast<PyObject*>(const_cast<RecordObject*>(r)));
      if (in_cache < 0) throw py::error_already_set();
      if (r->evicted || r->waits != 0 || in_cache) return false;
      if (storage_alive(r)) room -= r->nbytes;  // available: not evicted, not cached (both ruled out)
      if (room < 0) return false;
    }
    push_children(r);
  }
  return true;
}

// A leaf read by recipes that only recipes hold: its hold tensor is alive, its storage's only
// holder, and it is unpinned. A hold whose tensor died is cleared here.
bool held_by_recipes_only(RecordObject* r) {
  PyObject* h = PyWeakref_Check(r->hold) ? PyWeakref_GetObject(r->hold) : Py_None;
  if (h == Py_None) {
    Py_INCREF(Py_None);
    Py_SETREF(r->hold, Py_None);
    return false;
  }
  if (r->pins != 0 || !THPVariable_Check(h)) return false;
  return storage_use_count(THPVariable_Unpack(h)) <= 1;
}

}  // namespace

py::list sweep_records(py::dict table, py::object mark_gone, py::dict cache) {
  std::vector<std::pair<py::object, py::object>> found;  // (key, record): the table cannot change while walked
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(table.ptr(), &pos, &key, &value))
    if (!storage_alive(record_of(value)))
      found.emplace_back(py::reinterpret_borrow<py::object>(key), py::reinterpret_borrow<py::object>(value));
  std::vector<py::object> dead;
  dead.reserve(found.size());
  for (auto& [k, r] : found) {
    if (PyDict_DelItem(table.ptr(), k.ptr()) < 0) throw py::error_already_set();
    dead.push_back(std::move(r));
  }
  std::sort(dead.begin(), dead.end(), [](const py::object& a, const py::object& b) {
    return reinterpret_cast<RecordObject*>(a.ptr())->id < reinterpret_cast<RecordObject*>(b.ptr())->id;
  });
  while (!dead.empty()) {  // youngest first
    RecordObject* r = reinterpret_cast<RecordObject*>(dead.back().ptr());
    Py_INCREF(Py_None);
    Py_XSETREF(r->host, Py_None);  // host memory is not kept for a value no tensor holds
    if (!mark_gone.is_none() && r->recipe != nullptr && r->recipe != Py_None && has_live_child(r))
      mark_gone(dead.back());
    dead.pop_back();  // dropped here, unless mark_gone kept it
  }
  py::list held;
  pos = 0;
  while (PyDict_Next(table.ptr(), &pos, &key, &value)) {
    RecordObject* r = reinterpret_cast<RecordObject*>(value);
    if (r->children != nullptr && PyList_Check(r->children) && PyList_GET_SIZE(r->children) > 64) prune_children(r);
    if (r->hold != nullptr && r->hold != Py_None && held_by_recipes_only(r))
      held.append(py::make_tuple(py::handle(value), orphan_release_may_pay(r, cache.ptr())));
  }
  return held;
}

}  // namespace pymem
