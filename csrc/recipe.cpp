// recipe.cpp — _C.RecipeBase: a recipe captured in C++, made Python on first read (see recipe.h).
#include "recipe.h"

#include "intercept.h"
#include "py_type.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <structmember.h>

#include <cstddef>

namespace py = pybind11;

namespace pymem {
namespace {

PyTypeObject g_type{};  // a static type, filled by bind_recipe

// A wrapped number (the 0-dim tensor `x + 1` makes of its 1) as its scalar: what Python sees
// (torch::jit::toPyObject), without holding the tensor's buffer.
c10::IValue wrapped_number_value(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::ScalarType::Bool: return *t.const_data_ptr<bool>();
    case at::ScalarType::Long: return *t.const_data_ptr<int64_t>();
    case at::ScalarType::Double: return *t.const_data_ptr<double>();
    case at::ScalarType::ComplexDouble: return c10::IValue(c10::complex<double>(*t.const_data_ptr<c10::complex<double>>()));
    default: return c10::IValue(t.item());
  }
}

bool is_wrapped_number(const c10::IValue& v) {
  return v.isTensor() && v.toTensor().defined() && v.toTensor().unsafeGetTensorImpl()->is_wrapped_number();
}

// The list rule of the Python path's template (runtime._template): these lists are walked item by item.
bool walked_list(const c10::IValue& v) {
  return v.isTensorList() || (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList());
}

// The Python types a materialized recipe is made of (records.py), fetched on first use.
struct PythonTypes {
  py::object arg_ref, slot;
  py::list slots;  // Slot(0) .. Slot(255), shared as runtime._SLOTS shares them
  py::object rec, leaf, dtype, size, stride, offset, conj, neg, mutated, blank_nbytes, ret;
};
PythonTypes* g_py = nullptr;  // never freed: lives as long as the process

const PythonTypes& python_types() {
  if (g_py != nullptr) return *g_py;
  auto* p = new PythonTypes();
  py::module_ records = py::module_::import("pymem.runtime.records");
  p->arg_ref = records.attr("ArgRef");
  p->slot = records.attr("Slot");
  p->slots = py::module_::import("pymem.runtime.runtime").attr("_SLOTS");
#define PYMEM_NAME(n) p->n = py::reinterpret_steal<py::object>(PyUnicode_InternFromString(#n));
  PYMEM_NAME(rec) PYMEM_NAME(leaf) PYMEM_NAME(dtype) PYMEM_NAME(size) PYMEM_NAME(stride) PYMEM_NAME(offset)
  PYMEM_NAME(conj) PYMEM_NAME(neg) PYMEM_NAME(mutated) PYMEM_NAME(blank_nbytes)
#undef PYMEM_NAME
  p->ret = py::str("ret");
  g_py = p;
  return *p;
}

py::tuple int_tuple(c10::ArrayRef<int64_t> v) {
  py::tuple out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = py::int_(v[i]);
  return out;
}

// ArgRef(rec, leaf, t, False) for the captured input, without running ArgRef.__init__.
py::object arg_ref(const PythonTypes& P, const CapturedRef& c) {
  auto* type = reinterpret_cast<PyTypeObject*>(P.arg_ref.ptr());
  py::tuple no_args(0);
  py::object a = py::reinterpret_steal<py::object>(type->tp_new(type, no_args.ptr(), nullptr));
  if (!a) throw py::error_already_set();
  a.attr(P.rec) = c.rec ? c.rec : py::none();
  a.attr(P.leaf) = c.leaf ? c.leaf : py::none();
  a.attr(P.dtype) = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(c.dtype)));
  a.attr(P.size) = int_tuple(c.size);
  a.attr(P.stride) = int_tuple(c.stride);
  a.attr(P.offset) = py::int_(c.offset);
  a.attr(P.conj) = py::bool_(c.conj);
  a.attr(P.neg) = py::bool_(c.neg);
  a.attr(P.mutated) = py::bool_(false);
  a.attr(P.blank_nbytes) = py::int_(0);
  return a;
}

// The captured recipe's Python form, as run_op would have made it; the capture is dropped.
void materialize(RecipeObject* self) {
  const PythonTypes& P = python_types();
  const Capture& c = *self->captured;
  py::list refs(c.refs.size());
  for (size_t j = 0; j < c.refs.size(); ++j) refs[j] = arg_ref(P, c.refs[j]);
  size_t cursor = 0;
  auto slot_at = [&](int32_t arg, int32_t item) -> py::object {
    if (cursor >= c.slots.size() || c.slots[cursor] != std::make_pair(arg, item)) return py::object();
    const size_t i = cursor++;
    return i < 256 ? py::reinterpret_borrow<py::object>(PyList_GET_ITEM(P.slots.ptr(), i)) : P.slot(i);
  };
  auto [args, kwargs] = python_call_arguments(*c.schema, [&](size_t i) -> py::object {
    const c10::IValue& v = c.args[i];
    const auto arg = static_cast<int32_t>(i);
    if (py::object s = slot_at(arg, -1)) return s;
    if (!walked_list(v)) return torch::jit::toPyObject(v);
    const auto items = v.toListRef();
    py::list out(items.size());
    for (size_t k = 0; k < items.size(); ++k) {
      py::object s = slot_at(arg, static_cast<int32_t>(k));
      out[k] = s ? std::move(s) : torch::jit::toPyObject(items[k]);
    }
    return std::move(out);
  });
  py::object out = py::make_tuple(P.ret, self->out_index);
  Py_XSETREF(self->func, c.func.inc_ref().ptr());
  Py_XSETREF(self->args, args.release().ptr());
  Py_XSETREF(self->kwargs, kwargs.release().ptr());
  Py_XSETREF(self->refs, refs.release().ptr());
  Py_XSETREF(self->out, out.release().ptr());
  Py_XSETREF(self->rng, py::none().release().ptr());
  delete self->captured;
  self->captured = nullptr;
}

RecipeObject* as_recipe(PyObject* o) { return reinterpret_cast<RecipeObject*>(o); }

// The Python fields, by offset: one getter and one setter serve all six.
template <PyObject* RecipeObject::*field>
PyObject* get_field(PyObject* self, void*) {
  RecipeObject* r = as_recipe(self);
  if (r->captured != nullptr) {
    try {
      materialize(r);
    } catch (py::error_already_set& e) {
      e.restore();
      return nullptr;
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  PyObject* v = r->*field != nullptr ? r->*field : Py_None;
  Py_INCREF(v);
  return v;
}

template <PyObject* RecipeObject::*field>
int set_field(PyObject* self, PyObject* value, void* closure) {
  RecipeObject* r = as_recipe(self);
  if (r->captured != nullptr) {  // the other fields keep the captured values
    PyObject* made = get_field<field>(self, closure);
    if (made == nullptr) return -1;
    Py_DECREF(made);
  }
  Py_XINCREF(value);
  Py_XSETREF(r->*field, value);
  return 0;
}

#define PYMEM_FIELD(name) \
  {#name, get_field<&RecipeObject::name>, set_field<&RecipeObject::name>, nullptr, nullptr}
PyGetSetDef g_getset[] = {
    PYMEM_FIELD(func), PYMEM_FIELD(args), PYMEM_FIELD(kwargs), PYMEM_FIELD(refs), PYMEM_FIELD(out), PYMEM_FIELD(rng),
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};
#undef PYMEM_FIELD

// [a.rec for a in refs if a.rec is not None], from either form.
PyObject* input_records(PyObject* self, PyObject*) {
  try {
    std::vector<PyObject*> recs;
    append_input_records(self, recs);
    py::list out;  // append takes each reference before anything else can run
    for (PyObject* r : recs) out.append(py::handle(r));
    return out.release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  }
}

PyMethodDef g_methods[] = {
    {"input_records", input_records, METH_NOARGS, "The records of the recipe's recomputable inputs, in order."},
    {nullptr, nullptr, 0, nullptr},
};

template <class F>
void each_object(RecipeObject* r, F&& f) {
  f(r->func);
  f(r->args);
  f(r->kwargs);
  f(r->refs);
  f(r->out);
  f(r->rng);
}

PyObject* recipe_new(PyTypeObject* type, PyObject*, PyObject*) { return type->tp_alloc(type, 0); }

int recipe_traverse(PyObject* self, visitproc visit, void* arg) {
  RecipeObject* r = as_recipe(self);
  int out = 0;
  each_object(r, [&](PyObject* o) {
    if (out == 0 && o != nullptr) out = visit(o, arg);
  });
  if (out == 0 && r->captured != nullptr) {
    if (r->captured->func) Py_VISIT(r->captured->func.ptr());
    for (const CapturedRef& c : r->captured->refs) {
      if (c.rec) Py_VISIT(c.rec.ptr());
      if (c.leaf) Py_VISIT(c.leaf.ptr());
    }
  }
  return out;
}

int recipe_clear(PyObject* self) {
  RecipeObject* r = as_recipe(self);
  each_object(r, [](PyObject*& o) { Py_CLEAR(o); });
  Capture* c = r->captured;
  r->captured = nullptr;
  delete c;  // drops its references
  return 0;
}

void recipe_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  if (as_recipe(self)->weakrefs != nullptr) PyObject_ClearWeakRefs(self);
  recipe_clear(self);
  Py_TYPE(self)->tp_free(self);
}

}  // namespace

void append_input_records(PyObject* recipe, std::vector<PyObject*>& out) {
  if (!PyObject_TypeCheck(recipe, &g_type)) throw py::type_error("pymem: a recipe is no RecipeBase");
  RecipeObject* r = as_recipe(recipe);
  if (r->captured != nullptr) {
    for (const CapturedRef& c : r->captured->refs)
      if (c.rec) out.push_back(c.rec.ptr());
    return;
  }
  if (r->refs == nullptr || r->refs == Py_None) return;
  static PyObject* rec_name = PyUnicode_InternFromString("rec");
  for (py::handle a : py::reinterpret_borrow<py::object>(r->refs)) {
    py::object rec = a.attr(rec_name);
    if (!rec.is_none()) out.push_back(rec.ptr());  // borrowed: the ArgRef holds it
  }
}

Capture capture_arguments(py::object func, const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> stack) {
  Capture c;
  c.func = std::move(func);
  c.schema = &schema;
  c.args.reserve(stack.size());
  for (size_t i = 0; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    const auto arg = static_cast<int32_t>(i);
    if (is_tensor_arg(v)) {
      c.args.emplace_back(at::Tensor());
      c.slots.emplace_back(arg, -1);
    } else if (is_wrapped_number(v)) {
      c.args.push_back(wrapped_number_value(v.toTensor()));
    } else if (walked_list(v) && any_tensor_arg(v, [](const at::Tensor&) { return true; })) {
      const auto items = v.toListRef();
      const bool tensors = v.isTensorList();
      c10::impl::GenericList copy(tensors ? c10::TensorType::get() : v.toList().elementType());
      copy.reserve(items.size());
      for (size_t k = 0; k < items.size(); ++k) {
        if (is_tensor_arg(items[k])) {
          copy.push_back(tensors ? c10::IValue(at::Tensor()) : c10::IValue());
          c.slots.emplace_back(arg, static_cast<int32_t>(k));
        } else {
          copy.push_back(items[k]);
        }
      }
      c.args.emplace_back(tensors ? c10::IValue(c10::impl::toTypedList<at::Tensor>(std::move(copy)))
                                  : c10::IValue(std::move(copy)));
    } else {
      c.args.push_back(v);
    }
  }
  return c;
}

py::object new_captured_recipe(PyTypeObject* type, Capture capture, int64_t out_index) {
  py::object o = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));  // zeroed, GC-tracked
  if (!o) throw py::error_already_set();
  RecipeObject* r = as_recipe(o.ptr());
  r->captured = new Capture(std::move(capture));
  r->out_index = out_index;
  return o;
}

PyTypeObject* recipe_base_type() { return &g_type; }

void bind_recipe(py::module_& m) {  // bindings.cpp calls it
  g_type.tp_getset = g_getset;
  g_type.tp_methods = g_methods;
  ready_gc_type(m, "RecipeBase", g_type,
                {"pymem._C.RecipeBase",
                 "A recipe's fields; captured in C++ by the fast path and made Python on first read (csrc/recipe.h).",
                 sizeof(RecipeObject), offsetof(RecipeObject, weakrefs), recipe_new, recipe_dealloc, recipe_traverse,
                 recipe_clear});
}

}  // namespace pymem
