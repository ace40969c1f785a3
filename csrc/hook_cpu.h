// hook_cpu.h — the arena as PyTorch's CPU allocator (c10::SetCPUAllocator).
#pragma once

#include <memory>

#include "arena.h"

namespace pymem {

// Route every later CPU tensor allocation through `arena`. Tensors allocated before keep their own
// deleters. Installing while another arena is installed replaces it (its tensors stay valid); while
// another hook is, throws InvalidArgument (allocator_install.h).
void install_cpu_hook(std::shared_ptr<Arena> arena);
// Give PyTorch back the allocator it had before the first install. Tensors made while the hook was
// installed stay valid and are freed into their arena when they die. No-op if not installed.
void uninstall_cpu_hook();
// The arena currently installed, or null.
std::shared_ptr<Arena> cpu_hook_arena();
// True for buffers the hook allocated (their DataPtr context is their address; the deleter frees
// into whichever hooked arena holds it): the only buffers compaction may repoint.
bool is_cpu_hook_buffer(const void* data, const void* context, void (*deleter)(void*));
// Frees that arrived for a pointer no hooked arena owns (should stay 0; a deleter cannot throw).
uint64_t cpu_hook_bad_frees();

}  // namespace pymem
