// allocator_install.h — the one owner of PyTorch's CPU allocator slot (c10::SetCPUAllocator).
//
// pymem has three CPU hooks (CpuHookKind, types.h); each keeps only how its allocator allocates and
// frees. Which hook is installed, their mutual exclusion, and the allocator a hook replaced (given
// back at uninstall) live here, behind one lock, so no hook reads another's state.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <functional>
#include <optional>

#include "types.h"

namespace pymem {

// Makes `allocator` PyTorch's CPU allocator on behalf of hook `kind`, all under the install lock:
//  1. throws InvalidArgument, changing nothing, while a hook of another kind is installed;
//  2. runs `set_state(fresh, replaced)`: the hook records what its allocator needs. `fresh`: `kind`
//     was not installed (false: a reinstall, which only updates that state). `replaced`: the
//     allocator in place now, which `allocator` is about to replace, or null if `allocator` holds the
//     slot already. It may throw to refuse, and must then have changed nothing;
//  3. registers `allocator` unless it holds the slot already, saving the one it replaces.
void install_cpu_allocator(CpuHookKind kind, c10::Allocator* allocator,
                           const std::function<void(bool fresh, c10::Allocator* replaced)>& set_state);

// If `kind` is installed: gives PyTorch back the allocator its install replaced (unless someone
// replaced ours meanwhile: theirs stays), then runs `clear_state()` under the install lock. A no-op
// otherwise. Buffers made meanwhile keep their deleters, so they stay valid.
void uninstall_cpu_allocator(CpuHookKind kind, const std::function<void()>& clear_state);

// The hook installed now (CpuHookKind::None if none).
CpuHookKind installed_cpu_hook();

// Raise `e` from inside a hook's allocator: as pymem.OutOfBudgetError with its attributes when
// Python runs (PyTorch's op wrappers pass it through as-is), else as c10's OutOfMemoryError.
[[noreturn]] void raise_out_of_budget_in_allocator(const OutOfBudget& e);

// c10's OutOfMemoryError carrying the arena's refusal, as the CUDA library's block provider throws
// it. Code that retries with less memory when the allocator refuses catches only c10's type: cuDNN's
// plan search halves its workspace request and tries plans that need less; a Python error would end
// the convolution instead. pymem's translators turn it into pymem.OutOfBudgetError with its figures.
class ArenaRefusal final : public c10::OutOfMemoryError {
 public:
  explicit ArenaRefusal(const OutOfBudget& cause);
  const OutOfBudget& cause() const noexcept { return cause_; }

 private:
  OutOfBudget cause_;
};

// Throws ArenaRefusal(e), first kept as this thread's last refusal and counted.
[[noreturn]] void raise_arena_refusal(const OutOfBudget& e);

// How many ArenaRefusals this thread has thrown: a kernel that returns with it moved went on after
// a refusal (runtime/fallbacks.py).
uint64_t arena_refusals_here() noexcept;

// This thread's last refusal thrown as ArenaRefusal, then forgotten. PyTorch's own translation of
// c10's OutOfMemoryError into torch.OutOfMemoryError keeps only the message; this gives the figures.
std::optional<OutOfBudget> take_last_refusal();

}  // namespace pymem
