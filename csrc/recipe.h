// recipe.h — a recipe captured in C++ by the fast path, read from Python as a records.Recipe.
//
// Most recipes are never read: a value is recomputed only under pressure. So the fast path keeps
// what run_op would turn into Python objects (the argument template, one ArgRef per tensor
// argument) as C++ values, and _C.RecipeBase makes the Python objects the first time anything
// reads `func`, `args`, `kwargs`, `refs`, `out` or `rng` (remat.py, under pressure); from then on
// they are the recipe (remat may rewrite an ArgRef's `leaf`). `input_records()` reads either form
// without making anything: DTR's neighbourhood asks for it of every value that dies.
// records.Recipe subclasses RecipeBase; a recipe made in Python (run_op's path) has the Python
// fields from its __init__ and never a capture.
//
// Invariants:
//  - Touched under the GIL only; `captured` and the Python fields are never both in use: a capture
//    is replaced by its Python form in one step (materialize).
//  - A capture holds no tensor argument: records are weak to their storages, and a recipe must not
//    keep an input's buffer alive (a leaf is kept through its shared hold tensor, as in Python).
#pragma once

#include <pybind11/pybind11.h>

#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace pymem {

// records.ArgRef of an input the op does not write: a view (dtype, size, stride, offset, math
// bits) of `rec`'s value, or of the leaf hold tensor `leaf`; exactly one of the two is set.
struct CapturedRef {
  pybind11::object rec;
  pybind11::object leaf;
  at::ScalarType dtype = at::ScalarType::Undefined;
  c10::SmallVector<int64_t, 5> size, stride;
  int64_t offset = 0;
  bool conj = false, neg = false;
};

// func(*args, **kwargs) as the op was called, tensors taken out. Small vectors: one heap block per
// capture (the Capture itself), not one per field, on the fast path of every op.
struct Capture {
  pybind11::object func;                      // the OpOverload
  const c10::FunctionSchema* schema = nullptr;  // the dispatcher's, alive as long as the op
  // The op's arguments, each tensor argument replaced by an undefined tensor (a list holding one is
  // copied first: the caller's list is not ours to change).
  c10::SmallVector<c10::IValue, 6> args;
  // Where each tensor argument was, in order: (argument, list item or -1). Slot i of the template.
  c10::SmallVector<std::pair<int32_t, int32_t>, 4> slots;
  c10::SmallVector<CapturedRef, 2> refs;  // one per slot
};

struct RecipeObject {
  PyObject_HEAD
  PyObject* weakrefs;
  // The Python form (records.Recipe's fields); NULL while captured, or until set.
  PyObject* func;
  PyObject* args;
  PyObject* kwargs;
  PyObject* refs;
  PyObject* out;
  PyObject* rng;
  Capture* captured;  // owned; null once materialized (or for a recipe made in Python)
  int64_t out_index;  // a captured recipe's output: out = ("ret", out_index)
};

// The op's arguments (`stack`: the schema's arguments, as the kernel got them) with tensors taken
// out; `refs` is left for the caller to fill, one per slot.
Capture capture_arguments(pybind11::object func, const c10::FunctionSchema& schema,
                          c10::ArrayRef<c10::IValue> stack);

// A new recipe of `type` (records.Recipe) for output `out_index` of the captured op. New reference.
pybind11::object new_captured_recipe(PyTypeObject* type, Capture capture, int64_t out_index);

PyTypeObject* recipe_base_type();

// Appends the records of `recipe`'s recomputable inputs, in order (what `input_records()` lists),
// from either form, borrowed: the recipe keeps them. `recipe` is a RecipeBase. Throws
// pybind11::error_already_set if reading a Python-form ArgRef fails.
void append_input_records(PyObject* recipe, std::vector<PyObject*>& out);

}  // namespace pymem
