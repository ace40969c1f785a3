// bindings.cpp — the pymem._C module. Built twice: the real one (with the torch CPU hook) and a
// torch-free one under ASan/UBSan for the property tests (PYMEM_NO_TORCH).
#include <pybind11/pybind11.h>

#ifndef PYMEM_NO_TORCH
#include "hook_cpu.h"
#endif

#ifndef PYMEM_MODULE_NAME
#define PYMEM_MODULE_NAME _C
#endif

namespace py = pybind11;

namespace pymem {
void bind_arena(py::module_& m);  // bindings_arena.cpp
}

PYBIND11_MODULE(PYMEM_MODULE_NAME, m) {
  m.doc() = "pymem's C++ core: the budget arena, its window search, and the PyTorch CPU hook.";
  pymem::bind_arena(m);
#ifndef PYMEM_NO_TORCH
  m.attr("HAS_TORCH_HOOK") = true;
  m.def("install_cpu_hook", &pymem::install_cpu_hook, py::arg("arena"),
        "Make `arena` (a 'host' Arena) PyTorch's CPU allocator. Earlier tensors keep their deleters.");
  m.def("uninstall_cpu_hook", &pymem::uninstall_cpu_hook,
        "Restore the CPU allocator PyTorch had before; tensors made meanwhile stay valid.");
  m.def("cpu_hook_arena", &pymem::cpu_hook_arena, "The installed arena, or None.");
  m.def("cpu_hook_bad_frees", &pymem::cpu_hook_bad_frees);
#else
  m.attr("HAS_TORCH_HOOK") = false;
#endif
}
