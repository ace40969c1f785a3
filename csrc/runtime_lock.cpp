// runtime_lock.cpp — _C.RuntimeLock (see runtime_lock.h).
#include "runtime_lock.h"

#include <pybind11/pybind11.h>

#include <new>

namespace py = pybind11;

namespace pymem {
namespace {

PyTypeObject g_type{};  // a static type, filled by bind_runtime_lock

// Takes the lock if that needs no waiting: the caller holds it already, or nobody does.
bool try_acquire(LockObject* l) {
  const unsigned long me = PyThread_get_thread_ident();
  if (l->count > 0 && l->owner == me) {
    ++l->count;
    return true;
  }
  if (!l->mutex->try_lock()) return false;
  l->owner = me;
  l->count = 1;
  return true;
}

PyObject* lock_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if ((args != nullptr && PyTuple_GET_SIZE(args) != 0) || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "pymem._C.RuntimeLock() takes no arguments");
    return nullptr;
  }
  auto* l = reinterpret_cast<LockObject*>(type->tp_alloc(type, 0));
  if (l == nullptr) return nullptr;
  l->mutex = new (std::nothrow) std::mutex();
  if (l->mutex == nullptr) {
    Py_DECREF(l);
    return PyErr_NoMemory();
  }
  return reinterpret_cast<PyObject*>(l);
}

void lock_dealloc(PyObject* self) {
  auto* l = reinterpret_cast<LockObject*>(self);
  if (l->mutex != nullptr) {
    if (l->count > 0) l->mutex->unlock();  // destroying a held mutex is undefined
    delete l->mutex;
  }
  Py_TYPE(self)->tp_free(self);
}

PyObject* py_acquire(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"blocking", nullptr};
  int blocking = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p:acquire", const_cast<char**>(names), &blocking)) return nullptr;
  auto* l = reinterpret_cast<LockObject*>(self);
  if (!blocking) return PyBool_FromLong(try_acquire(l));
  lock_acquire(l);
  Py_RETURN_TRUE;
}

PyObject* py_release(PyObject* self, PyObject*) {
  if (!lock_release(reinterpret_cast<LockObject*>(self))) return nullptr;
  Py_RETURN_NONE;
}

PyObject* py_enter(PyObject* self, PyObject*) {
  lock_acquire(reinterpret_cast<LockObject*>(self));
  Py_RETURN_TRUE;
}

PyObject* py_exit(PyObject* self, PyObject*) { return py_release(self, nullptr); }

PyObject* py_is_owned(PyObject* self, PyObject*) {
  auto* l = reinterpret_cast<LockObject*>(self);
  return PyBool_FromLong(l->count > 0 && l->owner == PyThread_get_thread_ident());
}

PyMethodDef g_methods[] = {
    {"acquire", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_acquire)), METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True): as threading.RLock's (no timeout)"},
    {"release", py_release, METH_NOARGS, "release(): as threading.RLock's"},
    {"__enter__", py_enter, METH_NOARGS, nullptr},
    {"__exit__", py_exit, METH_VARARGS, nullptr},
    {"_is_owned", py_is_owned, METH_NOARGS, "whether the calling thread holds it"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void lock_acquire(LockObject* l) {
  if (try_acquire(l)) return;
  Py_BEGIN_ALLOW_THREADS
  l->mutex->lock();
  Py_END_ALLOW_THREADS
  l->owner = PyThread_get_thread_ident();
  l->count = 1;
}

bool lock_release(LockObject* l) {
  if (l->count == 0 || l->owner != PyThread_get_thread_ident()) {
    PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
    return false;
  }
  if (--l->count == 0) l->mutex->unlock();
  return true;
}

PyTypeObject* runtime_lock_type() { return &g_type; }

void bind_runtime_lock(py::module_& m) {  // bindings.cpp calls it
  Py_SET_REFCNT(reinterpret_cast<PyObject*>(&g_type), 1);
  g_type.tp_name = "pymem._C.RuntimeLock";
  g_type.tp_doc = "The runtime's re-entrant lock: threading.RLock's contract, taken by the fast path without a Python call (csrc/runtime_lock.h).";
  g_type.tp_basicsize = sizeof(LockObject);
  g_type.tp_flags = Py_TPFLAGS_DEFAULT;
  g_type.tp_new = lock_new;
  g_type.tp_dealloc = lock_dealloc;
  g_type.tp_methods = g_methods;
  if (PyType_Ready(&g_type) < 0) throw py::error_already_set();
  Py_INCREF(&g_type);  // static: never freed
  m.attr("RuntimeLock") = py::handle(reinterpret_cast<PyObject*>(&g_type));
}

}  // namespace pymem
