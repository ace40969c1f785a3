// hook_cpu.h — the arena as PyTorch's CPU allocator (c10::SetCPUAllocator).
#pragma once

#include <memory>

#include "arena.h"

namespace pymem {

// Route every later CPU tensor allocation through `arena`. Tensors allocated before keep their own
// deleters. Installing while another arena is installed replaces it (its tensors stay valid).
void install_cpu_hook(std::shared_ptr<Arena> arena);
// Give PyTorch back the allocator it had before the first install. Tensors made while the hook was
// installed stay valid and are freed into their arena when they die. No-op if not installed.
void uninstall_cpu_hook();
// The arena currently installed, or null.
std::shared_ptr<Arena> cpu_hook_arena();
// True for buffers the hook allocated (their DataPtr context is their address; the deleter frees
// into whichever hooked arena holds it): the only buffers compaction may repoint.
bool is_cpu_hook_buffer(const void* data, const void* context, void (*deleter)(void*));
// Raise `e` from inside a c10 allocator: as pymem.OutOfBudgetError with its attributes when Python
// runs (PyTorch's op wrappers pass it through as-is), else as c10's OutOfMemoryError.
[[noreturn]] void raise_out_of_budget_in_allocator(const OutOfBudget& e);
// Frees that arrived for a pointer no hooked arena owns (should stay 0; a deleter cannot throw).
uint64_t cpu_hook_bad_frees();

}  // namespace pymem
