// bindings.cpp — the pymem._C module. Built twice: the real one (with the torch CPU hook) and a
// torch-free one under ASan/UBSan for the property tests (PYMEM_NO_TORCH).
#include <pybind11/pybind11.h>

#ifndef PYMEM_NO_TORCH
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor

#include "hook_cpu.h"
#include "storage.h"
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
  m.def("evict_storage", &pymem::evict_storage, py::arg("tensor"),
        "Free the tensor's storage in place (all views and saved tensors see it); returns its bytes.");
  m.def("adopt_storage", &pymem::adopt_storage, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        "Move src's buffer into dst's evicted storage without a copy; dst's _version is unchanged.");
  m.def("storage_is_evicted", &pymem::storage_is_evicted, py::arg("tensor"));
#else
  m.attr("HAS_TORCH_HOOK") = false;
#endif
}
