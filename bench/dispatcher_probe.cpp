// dispatcher_probe.cpp — the C++ interception issue 14 chose, measured in isolation (built by
// bench/dispatcher_bench.py; not part of pymem._C yet).
//
// A boxed fallback on DispatchKey::Fake, included in a thread's local dispatch key set while on. It
// sits below Autograd and ADInplaceOrView and above the backend, so it sees the same aten ops a
// TorchDispatchMode sees (forward, and the backward formulas' ops on the engine's threads, which
// inherit the thread-local key set), for every backend. torch 2.13 registers nothing on Fake; a
// later torch may (a C++ FakeTensor), so registration is tried at run time and reports why it failed.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;
std::atomic<int> g_bookkeeping{0};  // 0: redispatch only; 1: input scan + output table
std::atomic<int64_t> g_ops{0};
std::mutex g_mutex;  // guards the two below: the engine's threads run the fallback too
std::unordered_map<c10::StorageImpl*, int64_t> g_outputs;  // storage -> op sequence number
std::set<std::thread::id> g_threads;                        // threads whose ops were seen

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const int64_t seq = g_ops.fetch_add(1, std::memory_order_relaxed);
  const bool book = g_bookkeeping.load(std::memory_order_relaxed) != 0;
  if (book) {  // what a fast path must do per op: find each input's storage
    int64_t found = 0;
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const c10::IValue& v : torch::jit::last(*stack, op.schema().arguments().size()))
      if (v.isTensor() && v.toTensor().has_storage())
        found += g_outputs.count(v.toTensor().storage().unsafeGetStorageImpl());
    g_threads.insert(std::this_thread::get_id());
    (void)found;
  }
  {
    c10::impl::ExcludeDispatchKeyGuard self(kKey);  // a kernel's own nested ops are not seen, as in a mode
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
  }
  if (book) {  // and register each output
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const c10::IValue& v : torch::jit::last(*stack, op.schema().returns().size()))
      if (v.isTensor() && v.toTensor().has_storage()) g_outputs[v.toTensor().storage().unsafeGetStorageImpl()] = seq;
  }
}

std::unique_ptr<torch::Library> g_library;

std::string register_fallback() {
  if (g_library) return "ok";
  try {
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
    g_library = std::move(lib);
    return "ok";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

double add_loop_us(const at::Tensor& a, const at::Tensor& b, int64_t n) {
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) at::add(a, b);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_fallback", &register_fallback);
  m.def("set_included", [](bool on) { c10::impl::tls_set_dispatch_key_included(kKey, on); });
  m.def("set_bookkeeping", [](bool on) { g_bookkeeping = on ? 1 : 0; });
  m.def("ops", [] { return g_ops.load(); });
  m.def("reset", [] {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_ops = 0;
    g_outputs.clear();
    g_threads.clear();
  });
  m.def("num_threads_seen", [] { std::lock_guard<std::mutex> lock(g_mutex); return g_threads.size(); });
  m.def("add_loop_us", &add_loop_us, py::call_guard<py::gil_scoped_release>());
}
