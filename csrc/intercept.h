// intercept.h — seeing every aten op in C++, at the dispatcher (issue 14's choice; README
// "How pymem sees ops").
//
// A boxed fallback on DispatchKey::Fake. While a thread has that key in its local *included* set,
// every op it runs reaches the fallback after Autograd and ADInplaceOrView (so at the level a
// TorchDispatchMode sees: backward formulas' ops included, on the autograd engine's threads, which
// inherit the thread-local key sets) and before the backend kernel. torch 2.13 registers nothing on
// Fake; a later torch may, so registration happens at run time and says why it failed.
//
// Invariants:
//  - The fallback runs with Fake excluded on its thread: whatever it runs (the kernel, the
//    handler's Python, a recompute's ops) is pymem's own work and is not seen again.
//  - With no handler set, or with none of the op's tensor arguments on the managed device type,
//    the op goes straight below the key: no GIL, no Python.
//  - A Python error in the handler reaches the op's caller as that error (persisted, so that it
//    crosses from an autograd engine thread to the thread that called backward()).
#pragma once

#include <pybind11/pybind11.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/function_schema.h>
#include <c10/core/DeviceType.h>

#include <string>

namespace pymem {

// A tensor pymem manages: on the managed device type, a plain tensor (not a Python subclass such as
// FakeTensor, whose fake device hides a meta storage), its storage (if any) on that device too.
inline bool is_managed_tensor(const at::Tensor& t, c10::DeviceType device) {
  if (!t.defined() || t.device().type() != device || t.key_set().has(c10::DispatchKey::Python)) return false;
  return !t.has_storage() || t.storage().device_type() == device;
}

// A tensor argument as Python sees it (torch::jit::toPyObject): an optional tensor passed as an
// undefined one (F.conv2d's bias=None reaches the dispatcher so) is None, and a wrapped number (the
// 0-dim tensor `x + 1` makes of its 1) is that Python number; neither is an input to record.
inline bool is_tensor_arg(const c10::IValue& v) {
  if (!v.isTensor()) return false;
  const at::Tensor& t = v.toTensor();
  return t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number();
}

// f(tensor) for each tensor in argument `v` (itself, or the items of a Tensor[] / Tensor?[] list), as
// Python sees them (is_tensor_arg), until f returns true; whether it did. The one walk of an op's
// tensor arguments: the fallback's filter and the fast path's inputs must agree on what they are.
template <class F>
bool any_tensor_arg(const c10::IValue& v, F&& f) {
  if (is_tensor_arg(v)) return f(v.toTensor());
  if (v.isList())  // a typed Tensor[] is a list too; toListRef reads it without copying
    for (const c10::IValue& x : v.toListRef())
      if (is_tensor_arg(x) && f(x.toTensor())) return true;
  return false;
}

// Registers the fallback (once per process). "" on success, else why it cannot be registered.
std::string install_interception();
bool interception_installed();

// handler(func, args, kwargs) -> the op's result, run for every op the fallback sees with a tensor
// argument on `device` (or no tensor argument: a factory). `func` is the op's OpOverload; the
// handler runs the op itself (calling `func` runs the kernel below the key). None: pass through.
void set_interception_handler(pybind11::object handler, c10::DeviceType device);

// The key in this thread's included set: its ops reach the fallback. Returns the prior state.
bool set_included_on_this_thread(bool on);
// The key in this thread's excluded set: its ops do not (pymem's own work outside an op: a
// restore for a raw read, an offload's copy). Returns the prior state.
bool set_excluded_on_this_thread(bool on);
bool included_on_this_thread();

// The op's arguments as a Python call's (args, kwargs), keyword-only ones by name: `convert(i)`
// makes the i-th argument's Python value. The Python path's call and a recipe's template share it.
template <class Convert>
std::pair<pybind11::tuple, pybind11::dict> python_call_arguments(const c10::FunctionSchema& schema, Convert&& convert) {
  const auto& arguments = schema.arguments();
  size_t num_positional = 0;
  for (const auto& a : arguments) num_positional += a.kwarg_only() ? 0 : 1;
  pybind11::tuple args(num_positional);
  pybind11::dict kwargs;
  size_t p = 0;
  for (size_t i = 0; i < arguments.size(); ++i) {
    pybind11::object v = convert(i);
    if (arguments[i].kwarg_only())
      kwargs[pybind11::str(arguments[i].name())] = std::move(v);
    else
      args[p++] = std::move(v);
  }
  return {std::move(args), std::move(kwargs)};
}

}  // namespace pymem
