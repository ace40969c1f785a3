// fast_op.h — the bookkeeping of a common op, done in C++ (issue 14's hot path, first slice).
//
// The interception (intercept.cpp) offers every op it sees to run_fast_op first. An op qualifies
// when the runtime's Python path would do nothing but bookkeeping for it: an aten/prims op that
// draws no random numbers, is not a collective and grows no storage; that writes no argument, or
// writes only leaves no recipe reads and gets no recipe (a gradient summed in place, zero_, any op
// under no_recompute); none of whose inputs is released (evicted or offloaded); whose cost is timed
// or estimated by cost_model.CostModel itself (priced here as its `seconds` prices it); on a thread
// the runtime already counts as managed. For such an op this file does exactly what Runtime.run_op
// does (runtime.py: same records, recipes, clock, costs, locks), with no Python frame but a FLOP
// formula's: records are C structs (record.h) written field by field, the runtime's per-op fields
// too (runtime_state.h), and a fresh output's recipe is captured in C++ (recipe.h) and made Python
// only if something reads it. Anything else returns false with the stack untouched, and the op
// takes the Python path.
//
// A refused allocation in the kernel (the op is functional: it left no trace) also returns false,
// with the stack as it was: the Python path runs it again and retries as it does for any op.
#pragma once

#include <pybind11/pybind11.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace pymem {

// `runtime`: the Runtime whose records the fast path keeps (None: off): a _C.RuntimeBase
// (runtime_state.h) whose lock is a _C.RuntimeLock (runtime_lock.h), with the attributes run_op
// uses (table, running, residency, backend, sweep; see fast_op.cpp).
void set_fast_path(pybind11::object runtime);

// GIL held, Fake excluded (intercept.cpp). True: the op ran and its outputs are on the stack.
bool run_fast_op(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack);

struct FastPathStats {
  int64_t fast = 0;  // ops whose bookkeeping ran here
  int64_t slow = 0;  // ops handed to the Python path
};
FastPathStats fast_path_stats();

}  // namespace pymem
