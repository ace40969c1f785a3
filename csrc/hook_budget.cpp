// hook_budget.cpp — allocator="native" (see hook_budget.h).
//
// Buffers come from the wrapped allocator's raw_allocate and keep context == data, so c10's
// raw_allocate/raw_deallocate work on this allocator too. Their sizes live in a map, since the
// deleter gets only the pointer. The map, the wrapped allocator and the counters live for the life
// of the process: a buffer made under the hook may die after uninstall, from any thread.
#include "hook_budget.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "allocator_install.h"
#include "types.h"

namespace pymem {

namespace {

std::mutex g_mutex;  // guards everything below
// Size and install epoch of every live buffer: only the current install's buffers count against
// its budget (those of an earlier pymem.enable may outlive it and die at any time).
std::unordered_map<void*, std::pair<size_t, uint64_t>> g_sizes;
uint64_t g_epoch = 0;
BudgetHookStats g_stats;
// The allocator we wrap: set at the first install, never changes (buffers of every install die
// through its deleter, so a later install must wrap the same one).
c10::Allocator* g_inner = nullptr;
c10::DeleterFnPtr g_inner_delete = nullptr;

void budget_delete(void* ptr) {
  if (!ptr) return;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_sizes.find(ptr);
    if (it != g_sizes.end()) {
      if (it->second.second == g_epoch) {
        g_stats.allocated -= it->second.first;
        g_stats.num_frees++;
      }
      g_sizes.erase(it);
    }
  }
  g_inner_delete(ptr);
}

[[noreturn]] void raise_refused(size_t nbytes, size_t budget, size_t allocated) {
  raise_out_of_budget_in_allocator(
      OutOfBudget("pymem: out of budget (allocator='native'): cannot allocate " + std::to_string(nbytes) +
                      " bytes with " + std::to_string(allocated) + " of " + std::to_string(budget) +
                      " bytes allocated",
                  nbytes, budget, allocated, 0, allocated < budget ? budget - allocated : 0));
}

class BudgetCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (nbytes == 0) return {nullptr, nullptr, &budget_delete, cpu};
    bool refused = false;
    size_t budget = 0, allocated = 0;
    {
      // Reserve first, so two threads cannot both pass the check with the last free bytes.
      std::lock_guard<std::mutex> lock(g_mutex);
      budget = g_stats.budget;
      allocated = g_stats.allocated;
      refused = allocated > budget || nbytes > budget - allocated;
      if (refused)
        g_stats.num_refused++;
      else
        g_stats.allocated += nbytes;
    }
    if (refused) raise_refused(nbytes, budget, allocated);  // takes the GIL: never under our lock
    void* p = nullptr;
    try {
      p = g_inner->raw_allocate(nbytes);
    } catch (...) {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_stats.allocated -= nbytes;
      throw;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_sizes.emplace(p, std::make_pair(nbytes, g_epoch));
    g_stats.num_allocs++;
    if (g_stats.allocated > g_stats.peak) g_stats.peak = g_stats.allocated;
    return {p, p, &budget_delete, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &budget_delete; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

BudgetCPUAllocator g_allocator;

}  // namespace

void install_budget_hook(size_t budget) {
  install_cpu_allocator(CpuHookKind::Budget, &g_allocator, [&](bool fresh, c10::Allocator* replaced) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (fresh) {
      if (replaced) {  // checked before anything changes: a throw leaves the hook uninstalled
        if (g_inner && replaced != g_inner)
          throw InvalidArgument("pymem: the CPU allocator changed since the budget hook was first installed");
        if (!replaced->raw_deleter())
          throw InvalidArgument("pymem: the CPU allocator in place has no raw deleter; it cannot be wrapped");
        g_inner = replaced;
        g_inner_delete = replaced->raw_deleter();
      }
      g_epoch++;  // a fresh install counts only its own buffers, from zero
      g_stats = BudgetHookStats{};
    }
    g_stats.budget = budget;
  });
}

void uninstall_budget_hook() { uninstall_cpu_allocator(CpuHookKind::Budget, nullptr); }

bool budget_hook_installed() { return installed_cpu_hook() == CpuHookKind::Budget; }

BudgetHookStats budget_hook_stats() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_stats;
}

void budget_hook_reset_peak() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_stats.peak = g_stats.allocated;
}

}  // namespace pymem
