// movable.cpp — see movable.h.
#include "movable.h"

#include <pybind11/stl.h>

#include <stdexcept>
#include <unordered_set>

#include "record.h"
#include "release_scan.h"
#include "storage.h"

namespace py = pybind11;

namespace pymem {

py::dict movable_blocks(py::dict table, py::dict cache, uintptr_t lo, uintptr_t hi,
                        const std::vector<uintptr_t>& busy, py::handle leaf_ok) {
  const std::unordered_set<uintptr_t> in_use(busy.begin(), busy.end());
  py::dict out;
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  const Py_ssize_t size = PyDict_Size(table.ptr());
  while (PyDict_Next(table.ptr(), &pos, &key, &value)) {
    RecordObject* r = as_record(value);
    if (r == nullptr) throw std::logic_error("pymem: the runtime's table holds a value that is no Record");
    const StorageRef* s = storage_ref_of(r);
    if (s == nullptr || r->evicted || r->pins != 0) continue;  // pinned: someone outside torch holds its address
    const uintptr_t addr = s->data_ptr();
    if (addr < lo || addr >= hi || in_use.count(addr) != 0) continue;
    bool releasable = r->in_arena && r->locks == 0;
    if (releasable && (r->recipe == nullptr || r->recipe == Py_None)) {
      py::object record = py::reinterpret_borrow<py::object>(value);  // leaf_ok may run Python
      releasable = leaf_may_go(leaf_ok, record.ptr());
      if (PyDict_Size(table.ptr()) != size)
        throw std::runtime_error("pymem: the record table changed size while finding the blocks that may move");
    }
    py::object sref = py::handle(value).attr("sref");  // the Python StorageRef, made on first read
    out[py::int_(addr)] = py::make_tuple(py::handle(value), sref, releasable);
  }
  pos = 0;
  while (PyDict_Next(cache.ptr(), &pos, &key, &value)) {
    RecordObject* r = as_record(key);
    if (r == nullptr) throw std::logic_error("pymem: the recompute cache holds a key that is no Record");
    py::object sref = py::handle(value)[py::int_(0)];  // (StorageRef, tensor)
    const uintptr_t addr = sref.cast<const StorageRef&>().data_ptr();
    if (addr < lo || addr >= hi || in_use.count(addr) != 0) continue;
    const bool releasable = r->recipe != nullptr && r->recipe != Py_None && r->locks == 0;
    out[py::int_(addr)] = py::make_tuple(py::handle(key), sref, releasable);
  }
  return out;
}

}  // namespace pymem
