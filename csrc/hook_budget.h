// hook_budget.h — allocator="native": PyTorch's own CPU allocator, capped at a budget.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pymem {

// Counters of the budget hook (bytes are the sizes requested; the underlying allocator's own
// rounding and caching are its business, as with the caching allocator on CUDA).
struct BudgetHookStats {
  size_t budget = 0;
  size_t allocated = 0;
  size_t peak = 0;
  uint64_t num_allocs = 0;
  uint64_t num_frees = 0;
  uint64_t num_refused = 0;  // requests that would have passed the budget (raised OutOfBudget)
};

// Wrap the CPU allocator installed now (PyTorch's default) so that later CPU tensors come from it as
// before, but a request that would take the bytes held above `budget` raises OutOfBudget instead of
// being served — what set_per_process_memory_fraction does to the CUDA caching allocator. Nothing
// is released here: the runtime catches the error, releases values and runs the op again.
// Installing again only changes the budget. A fresh install starts its counters from zero and
// counts only its own buffers: those of an earlier install stay valid and are not charged to it.
// Throws InvalidArgument while another hook is installed (allocator_install.h).
void install_budget_hook(size_t budget);
// Give PyTorch its allocator back; buffers made meanwhile stay valid and are counted out as they die.
void uninstall_budget_hook();
bool budget_hook_installed();
BudgetHookStats budget_hook_stats();
void budget_hook_reset_peak();

}  // namespace pymem
