// py_errors.h — turning arena errors into Python exceptions (pybind11 side only).
#pragma once

#include <pybind11/pybind11.h>

#include "types.h"

namespace pymem {

// The Python class raised for OutOfBudget: pymem.OutOfBudgetError once pymem registers it
// (a torch.OutOfMemoryError subclass); MemoryError before that (e.g. the torch-free ASan build).
pybind11::handle out_of_budget_class();
void set_out_of_budget_class(pybind11::object cls);
// The Python exception for `e` (GIL held), not raised. Attributes as below.
pybind11::object out_of_budget_error(const OutOfBudget& e);
// Sets the Python error indicator for `e` (GIL held). Attributes: requested, budget, allocated,
// pinned_bytes, largest_free_block.
void set_python_out_of_budget(const OutOfBudget& e);
// Registers the translator for OutOfBudget (-> the class above) and InvalidArgument (-> ValueError).
void register_error_translators();

}  // namespace pymem
