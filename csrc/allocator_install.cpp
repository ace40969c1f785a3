// allocator_install.cpp — see allocator_install.h.
#include "allocator_install.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <string>

#include "py_errors.h"

namespace pymem {

namespace {

// Higher than anything PyTorch registers itself, so a hook wins; uninstall re-registers the
// replaced allocator at the same priority (SetCPUAllocator ignores a lower one).
constexpr uint8_t kHookPriority = 200;

std::mutex g_mutex;  // guards the three below, and runs every hook's set_state / clear_state
CpuHookKind g_kind = CpuHookKind::None;
c10::Allocator* g_installed = nullptr;  // the allocator `g_kind` registered
c10::Allocator* g_replaced = nullptr;   // the one it replaced: what uninstall gives back

// How the error names an installed hook, and one about to be installed.
const char* installed_name(CpuHookKind kind) {
  switch (kind) {
    case CpuHookKind::Arena: return "the arena";
    case CpuHookKind::Budget: return "the budget hook (allocator='native')";
    case CpuHookKind::Pluggable: return "the pluggable CPU hook";
    case CpuHookKind::None: break;
  }
  return "no hook";
}

const char* new_name(CpuHookKind kind) {
  return kind == CpuHookKind::Arena ? "an arena" : installed_name(kind);
}

}  // namespace

void install_cpu_allocator(CpuHookKind kind, c10::Allocator* allocator,
                           const std::function<void(bool fresh, c10::Allocator* replaced)>& set_state) {
  if (kind == CpuHookKind::None || !allocator) throw InvalidArgument("install_cpu_allocator needs a hook");
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_kind != CpuHookKind::None && g_kind != kind)
    throw InvalidArgument(std::string("pymem: ") + installed_name(g_kind) + " is installed as the CPU "
                          "allocator; uninstall it before installing " + new_name(kind));
  c10::Allocator* current = c10::GetCPUAllocator();
  c10::Allocator* replaced = current == allocator ? nullptr : current;
  set_state(g_kind != kind, replaced);  // may throw: nothing here has changed yet
  g_kind = kind;
  g_installed = allocator;
  if (replaced) {
    g_replaced = replaced;
    c10::SetCPUAllocator(allocator, kHookPriority);
  }
}

void uninstall_cpu_allocator(CpuHookKind kind, const std::function<void()>& clear_state) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_kind != kind) return;
  if (c10::GetCPUAllocator() == g_installed && g_replaced) c10::SetCPUAllocator(g_replaced, kHookPriority);
  g_kind = CpuHookKind::None;
  g_installed = nullptr;
  g_replaced = nullptr;
  if (clear_state) clear_state();
}

CpuHookKind installed_cpu_hook() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_kind;
}

void raise_out_of_budget_in_allocator(const OutOfBudget& e) {
  if (Py_IsInitialized()) {
    pybind11::gil_scoped_acquire gil;
    set_python_out_of_budget(e);
    throw pybind11::error_already_set();  // PyTorch's op wrappers restore it as-is
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
}

namespace {
thread_local std::optional<OutOfBudget> t_last_refusal;
thread_local uint64_t t_refusals = 0;
}  // namespace

ArenaRefusal::ArenaRefusal(const OutOfBudget& cause)
    : c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, cause.what()), cause_(cause) {}

void raise_arena_refusal(const OutOfBudget& e) {
  t_last_refusal = e;
  ++t_refusals;
  throw ArenaRefusal(e);
}

uint64_t arena_refusals_here() noexcept { return t_refusals; }

std::optional<OutOfBudget> take_last_refusal() {
  std::optional<OutOfBudget> taken;
  taken.swap(t_last_refusal);
  return taken;
}

}  // namespace pymem
