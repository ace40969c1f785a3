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

namespace {

// Calls on_table(record object, addr) for each table value that may move, then on_cache(record
// object, StorageRef object, addr) for each cached one. A cached entry's StorageRef is its
// Python object (the cache holds it), a table value's is made only where on_table asks.
template <typename OnTable, typename OnCache>
void walk(py::dict table, py::dict cache, uintptr_t lo, uintptr_t hi, const std::vector<uintptr_t>& busy,
          OnTable&& on_table, OnCache&& on_cache) {
  const std::unordered_set<uintptr_t> in_use(busy.begin(), busy.end());
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(table.ptr(), &pos, &key, &value)) {
    RecordObject* r = as_record(value);
    if (r == nullptr) throw std::logic_error("pymem: the runtime's table holds a value that is no Record");
    const StorageRef* s = storage_ref_of(r);
    if (s == nullptr || r->evicted || r->pins != 0) continue;  // pinned: someone outside torch holds its address
    const uintptr_t addr = s->data_ptr();
    if (addr < lo || addr >= hi || in_use.count(addr) != 0) continue;
    on_table(value, r, addr);
  }
  pos = 0;
  while (PyDict_Next(cache.ptr(), &pos, &key, &value)) {
    RecordObject* r = as_record(key);
    if (r == nullptr) throw std::logic_error("pymem: the recompute cache holds a key that is no Record");
    py::handle sref = PyTuple_Check(value) && PyTuple_GET_SIZE(value) > 0 ? py::handle(PyTuple_GET_ITEM(value, 0))
                                                                          : py::handle();
    if (!sref) throw std::logic_error("pymem: the recompute cache holds a value that is no (StorageRef, tensor)");
    const uintptr_t addr = sref.cast<const StorageRef&>().data_ptr();
    if (addr < lo || addr >= hi || in_use.count(addr) != 0) continue;
    on_cache(key, r, sref, addr);
  }
}

}  // namespace

py::dict movable_blocks(py::dict table, py::dict cache, uintptr_t lo, uintptr_t hi,
                        const std::vector<uintptr_t>& busy, py::handle leaf_ok) {
  py::dict out;
  const Py_ssize_t size = PyDict_Size(table.ptr());
  walk(
      table, cache, lo, hi, busy,
      [&](PyObject* value, RecordObject* r, uintptr_t addr) {
        bool releasable = r->in_arena && r->locks == 0;
        if (releasable && (r->recipe == nullptr || r->recipe == Py_None)) {
          py::object record = py::reinterpret_borrow<py::object>(value);  // leaf_ok may run Python
          releasable = leaf_may_go(leaf_ok, record.ptr());
          if (PyDict_Size(table.ptr()) != size)
            throw std::runtime_error("pymem: the record table changed size while finding the blocks that may move");
        }
        py::object sref = py::handle(value).attr("sref");  // the Python StorageRef, made on first read
        out[py::int_(addr)] = py::make_tuple(py::handle(value), sref, releasable);
      },
      [&](PyObject* key, RecordObject* r, py::handle sref, uintptr_t addr) {
        const bool releasable = r->recipe != nullptr && r->recipe != Py_None && r->locks == 0;
        out[py::int_(addr)] = py::make_tuple(py::handle(key), sref, releasable);
      });
  return out;
}

std::vector<uintptr_t> movable_addresses(py::dict table, py::dict cache, uintptr_t lo, uintptr_t hi,
                                         const std::vector<uintptr_t>& busy) {
  // An address met twice (a table value and a cached one) is listed twice; the arena's plan reads
  // the list as a set.
  std::vector<uintptr_t> out;
  out.reserve(static_cast<size_t>(PyDict_Size(table.ptr()) + PyDict_Size(cache.ptr())));
  walk(
      table, cache, lo, hi, busy, [&](PyObject*, RecordObject*, uintptr_t addr) { out.push_back(addr); },
      [&](PyObject*, RecordObject*, py::handle, uintptr_t addr) { out.push_back(addr); });
  return out;
}

}  // namespace pymem
