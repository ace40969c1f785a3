// intercept.cpp — the Fake-key fallback (see intercept.h).
#include "intercept.h"

#include "fast_op.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>
#include <memory>

namespace py = pybind11;

namespace pymem {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;

// Read without the GIL on every op; the handler object itself is touched only under the GIL.
std::atomic<bool> g_on{false};
std::atomic<int8_t> g_device{static_cast<int8_t>(c10::DeviceType::CPU)};
PyObject* g_handler = nullptr;  // owned; guarded by the GIL
std::unique_ptr<torch::Library> g_library;

// Whether the handler wants the op: a tensor argument on the managed device type, or no tensor
// argument at all (a factory, whose output may land on that device).
bool wanted(const torch::jit::Stack& stack, size_t num_args) {
  const auto device = static_cast<c10::DeviceType>(g_device.load(std::memory_order_relaxed));
  bool any_tensor = false;
  for (const c10::IValue& v : torch::jit::last(stack, num_args)) {
    const bool managed = any_tensor_arg(v, [&](const at::Tensor& t) {
      any_tensor = true;
      return is_managed_tensor(t, device);
    });
    if (managed) return true;
  }
  return !any_tensor;
}

// The op's arguments as Python (args, kwargs), keyword-only ones by name, popped off the stack.
std::pair<py::tuple, py::dict> pop_python_arguments(const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  const size_t n = schema.arguments().size();
  auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
  auto out = python_call_arguments(
      schema, [&](size_t i) { return torch::jit::toPyObject(std::move(first[static_cast<std::ptrdiff_t>(i)])); });
  torch::jit::drop(*stack, n);
  return out;
}

void push_python_result(const c10::FunctionSchema& schema, torch::jit::Stack* stack, const py::object& out) {
  const auto& returns = schema.returns();
  if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(out, returns[0].real_type()));
    return;
  }
  if (returns.empty()) return;
  py::tuple outs = py::reinterpret_borrow<py::tuple>(out);
  TORCH_CHECK(outs.size() == returns.size(), "pymem: ", schema.name(), " returned ", outs.size(),
              " values; its schema has ", returns.size());
  for (size_t i = 0; i < returns.size(); ++i)
    stack->push_back(torch::jit::toIValue(outs[i], returns[i].real_type()));
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard self(kKey);  // see intercept.h: nothing below is seen again
  const auto below = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
  const auto& schema = op.schema();
  if (!g_on.load(std::memory_order_acquire) || !wanted(*stack, schema.arguments().size())) {
    op.redispatchBoxed(below, stack);
    return;
  }
  py::gil_scoped_acquire gil;
  if (g_handler == nullptr) {  // set to None after the flag was read
    py::gil_scoped_release no_gil;
    op.redispatchBoxed(below, stack);
    return;
  }
  py::object handler = py::reinterpret_borrow<py::object>(g_handler);
  try {
    if (run_fast_op(op, below, stack)) return;
    py::handle func = torch::detail::getTorchApiFunction(op);
    auto [args, kwargs] = pop_python_arguments(schema, stack);
    py::object out = handler(func, std::move(args), std::move(kwargs));
    push_python_result(schema, stack, out);
  } catch (py::error_already_set& e) {
    // Keep the Python exception itself (pymem.OutOfBudgetError with its attributes), in a form
    // torch's bindings and the autograd engine rethrow as it is.
    e.restore();
    python_error err;
    err.persist();
    throw err;
  }
}

}  // namespace

std::string install_interception() {
  if (g_library) return "";
  try {
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
    g_library = std::move(lib);
    return "";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

bool interception_installed() { return g_library != nullptr; }

void set_interception_handler(py::object handler, c10::DeviceType device) {
  g_on.store(false, std::memory_order_release);
  PyObject* old = g_handler;
  g_handler = nullptr;
  Py_XDECREF(old);
  if (handler.is_none()) return;
  g_device.store(static_cast<int8_t>(device), std::memory_order_relaxed);
  g_handler = handler.release().ptr();
  g_on.store(true, std::memory_order_release);
}

bool set_included_on_this_thread(bool on) {
  const bool prior = c10::impl::tls_is_dispatch_key_included(kKey);
  c10::impl::tls_set_dispatch_key_included(kKey, on);
  return prior;
}

bool set_excluded_on_this_thread(bool on) {
  const bool prior = c10::impl::tls_is_dispatch_key_excluded(kKey);
  c10::impl::tls_set_dispatch_key_excluded(kKey, on);
  return prior;
}

bool included_on_this_thread() { return c10::impl::tls_is_dispatch_key_included(kKey); }

}  // namespace pymem
