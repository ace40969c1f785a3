// runtime_state.h — the runtime's per-op scalar state, in C.
//
// pymem/runtime/runtime.py's Runtime subclasses _C.RuntimeBase. The fields every op reads or
// writes (the logical clock, the op count, whether the runtime is active, whether ops get recipes,
// when the table is swept next, the cost model and the swapper) are members of this struct, so the
// fast path (fast_op.cpp) reads and writes them at a fixed offset instead of through the instance
// dict (an attribute lookup and, for a number, a fresh Python object per write). Python reads and
// writes them under the same names through member descriptors; the rest of the runtime stays in its
// instance dict.
//
// Beside it, two pieces of per-thread state the fast path reads for every op, kept in C
// thread-locals rather than Python's threading.local:
//  - whether this thread counts as managed by a runtime (ThreadCoverage.managed, cached per thread:
//    a thread marks itself; the mark names the runtime's serial, so a later runtime starts unmarked);
//  - the seconds this thread spent in the pressure handler (PressureHandler.spent), which an op's
//    measured cost leaves out.
//
// Invariants: touched under the GIL only. Object fields may be NULL (cleared, or never set) and
// then read as None.
#pragma once

#include <Python.h>

#include <cstdint>

namespace pymem {

struct RuntimeObject {
  PyObject_HEAD
  double clock;        // the logical clock: the sum of the costs of the ops run so far
  int64_t num_ops;
  int64_t no_recipes;  // > 0: ops get no recipes (optimizer steps, pymem.no_recompute)
  int64_t sweep_at;    // `_sweep_at`: the table size past which a new record sweeps it
  int64_t serial;      // unique per runtime, from 1: what a thread's managed mark names
  char active;         // char: what a T_BOOL member reads and writes
  PyObject* cost_model;  // None: costs are measured wall time
  PyObject* swap;        // the Swapper, or None (no offloading)
};

// _C.RuntimeBase, ready once the module is bound (bind_runtime_state).
PyTypeObject* runtime_base_type();

inline RuntimeObject* as_runtime(PyObject* o) {
  return PyObject_TypeCheck(o, runtime_base_type()) ? reinterpret_cast<RuntimeObject*>(o) : nullptr;
}

// The calling thread counts as managed by the runtime of serial `serial`.
bool thread_managed_by(int64_t serial);

// This thread's seconds in the pressure handler (monotone; an op subtracts two readings).
double handler_seconds();

}  // namespace pymem
