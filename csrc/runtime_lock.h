// runtime_lock.h — the runtime's lock (Runtime.lock), a re-entrant lock the fast path takes
// without a Python call.
//
// Same contract as threading.RLock, which it replaces: held by one thread at a time, re-entrant,
// released by its owner only, as many releases as acquisitions. Python uses it as before (`with
// rt.lock:`, acquire, release); fast_op.cpp calls lock_acquire/lock_release directly, twice per op
// (before the kernel and after it), where RLock cost two bound-method calls each.
//
// Waiting never holds the GIL: a contended acquire first tries without blocking, then releases the
// GIL while it blocks (the holder may need the GIL to finish). Touched under the GIL otherwise, so
// owner and count need no atomics: only the owner writes them, and only under the GIL.
#pragma once

#include <Python.h>
#include <cstdint>
#include <mutex>

namespace pymem {

struct LockObject {
  PyObject_HEAD
  std::mutex* mutex;    // owned; a futex word: an uncontended take is one atomic exchange
  unsigned long owner;  // PyThread_get_thread_ident of the holder; meaningful while count > 0
  int64_t count;        // acquisitions not yet released by the holder
};

PyTypeObject* runtime_lock_type();

inline LockObject* as_lock(PyObject* o) {
  return PyObject_TypeCheck(o, runtime_lock_type()) ? reinterpret_cast<LockObject*>(o) : nullptr;
}

// GIL held. Blocks (GIL released meanwhile) until the calling thread holds the lock.
void lock_acquire(LockObject* l);
// GIL held. False, with a Python RuntimeError set, when the calling thread does not hold it.
bool lock_release(LockObject* l);

}  // namespace pymem
