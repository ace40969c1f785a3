// bindings.cpp — the pymem._C module. Built twice: the real one (with the torch CPU hook) and a
// torch-free one under ASan/UBSan for the property tests (PYMEM_NO_TORCH).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#ifndef PYMEM_NO_TORCH
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor

#include <c10/core/CPUAllocator.h>

#include "allocator_install.h"
#include "hook_budget.h"
#include "hook_cpu.h"
#include "hook_pluggable.h"
#include "fast_op.h"
#include "intercept.h"
#include "movable.h"
#include "py_errors.h"
#include "storage.h"
#include "sweep.h"
#endif

#ifndef PYMEM_MODULE_NAME
#define PYMEM_MODULE_NAME _C
#endif

namespace py = pybind11;

namespace pymem {
void bind_arena(py::module_& m);  // bindings_arena.cpp
void bind_record(py::module_& m);  // record.cpp
void bind_recipe(py::module_& m);  // recipe.cpp
void bind_runtime_state(py::module_& m);  // runtime_state.cpp
void bind_runtime_lock(py::module_& m);  // runtime_lock.cpp
void bind_step_trace(py::module_& m);  // step_trace.cpp
void bind_host_pool(py::module_& m);  // host_pool_py.cpp
void bind_neighbourhood(py::module_& m);  // neighbourhood.cpp
void bind_release_scan(py::module_& m);  // release_scan.cpp
}

PYBIND11_MODULE(PYMEM_MODULE_NAME, m) {
  m.doc() = "pymem's C++ core: the budget arena, its window search, and the PyTorch CPU hook.";
  pymem::bind_arena(m);
#ifndef PYMEM_NO_TORCH
  m.attr("HAS_TORCH_HOOK") = true;
  pymem::bind_record(m);
  pymem::bind_recipe(m);
  pymem::bind_runtime_state(m);
  pymem::bind_runtime_lock(m);
  pymem::bind_step_trace(m);
  pymem::bind_host_pool(m);
  pymem::bind_neighbourhood(m);
  pymem::bind_release_scan(m);
  m.def("install_cpu_hook", &pymem::install_cpu_hook, py::arg("arena"),
        "Make `arena` (a 'host' Arena) PyTorch's CPU allocator. Earlier tensors keep their deleters.");
  m.def("uninstall_cpu_hook", &pymem::uninstall_cpu_hook,
        "Restore the CPU allocator PyTorch had before; tensors made meanwhile stay valid.");
  m.def("cpu_hook_arena", &pymem::cpu_hook_arena, "The installed arena, or None.");
  m.def("cpu_hook_bad_frees", &pymem::cpu_hook_bad_frees);
  m.def("arena_block_provider", &pymem::arena_block_provider, py::arg("arena"),
        "Address of a pymem_block_provider (cuda_lib.h) serving blocks from `arena`, for "
        "libpymem_cuda.so's pymem_cuda_set_provider. The arena then lives as long as the process.");
  m.def("install_pluggable_cpu_hook", &pymem::install_pluggable_cpu_hook, py::arg("alloc_fn"), py::arg("free_fn"),
        "Route CPU allocations to C functions with CUDAPluggableAllocator's signatures (addresses): "
        "runs libpymem_cuda.so on CPU tensors, over a fake CUDA table, in tests.");
  m.def("uninstall_pluggable_cpu_hook", &pymem::uninstall_pluggable_cpu_hook);
  m.def("set_pluggable_relocation", &pymem::set_pluggable_relocation, py::arg("relocate_fn"), py::arg("free_fn"),
        "pymem_cuda_relocate and pymem_cuda_free of the CUDA library (CudaLib.relocation_points()): how a\n"
        "storage whose library block compaction moved is repointed and, later, freed.");
  // Without the GIL, as PyTorch calls its allocator: the pressure handler takes it when it runs.
  m.def("call_pluggable_alloc", &pymem::call_pluggable_alloc, py::arg("alloc_fn"), py::arg("nbytes"),
        py::arg("device"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "alloc_fn(nbytes, device, stream) (libpymem_cuda.so's pymem_cuda_alloc, by address): a block "
        "provider's refusal raises pymem.OutOfBudgetError; 0 when the library refuses by itself.");
  // Registered after PyTorch's translator, so it runs first: it turns only ArenaRefusal.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pymem::ArenaRefusal& e) {
      pymem::take_last_refusal();  // raised here with its figures: nothing to take later
      pymem::set_python_out_of_budget(e.cause());
    }
  });
  m.def("take_last_refusal",
        []() -> py::object {
          std::optional<pymem::OutOfBudget> e = pymem::take_last_refusal();
          return e ? pymem::out_of_budget_error(*e) : py::none();
        },
        "The calling thread's last refusal thrown through the CUDA library (as c10's OutOfMemoryError, "
        "which PyTorch hands to Python as torch.OutOfMemoryError with its message only), as a "
        "pymem.OutOfBudgetError with its figures, then forgotten; None if there is none.");
  m.def("arena_refusals", &pymem::arena_refusals_here,
        "How many refusals the CUDA library's arena threw on this thread (as c10's OutOfMemoryError).");
  m.def("allocate_first_that_fits",
        [](const std::vector<size_t>& sizes) -> size_t {
          c10::Allocator* cpu = c10::GetCPUAllocator();
          for (size_t n : sizes) {
            try {
              c10::DataPtr p = cpu->allocate(n);
              return n;
            } catch (const c10::OutOfMemoryError&) {
            }
          }
          return 0;
        },
        py::arg("sizes"),
        "For tests: allocates each size in turn from PyTorch's CPU allocator until one is granted "
        "(freed at once), as cuDNN's plan search retries with smaller workspaces when the allocator "
        "raises c10's OutOfMemoryError; returns that size, or 0 if none was.");
  m.def("install_budget_hook", &pymem::install_budget_hook, py::arg("budget"),
        "allocator='native': keep PyTorch's CPU allocator, but refuse (OutOfBudgetError) any request "
        "that would hold more than `budget` bytes. Installing again changes the budget.");
  m.def("uninstall_budget_hook", &pymem::uninstall_budget_hook,
        "Give PyTorch its CPU allocator back; buffers made meanwhile stay valid.");
  m.def("budget_hook_installed", &pymem::budget_hook_installed);
  m.def("budget_hook_stats", [] {
    const pymem::BudgetHookStats s = pymem::budget_hook_stats();
    py::dict d;
    d["budget_bytes"] = s.budget;
    d["allocated_bytes.current"] = s.allocated;
    d["allocated_bytes.peak"] = s.peak;
    d["num_allocs"] = s.num_allocs;
    d["num_frees"] = s.num_frees;
    d["num_refused"] = s.num_refused;
    return d;
  }, "Counters of the budget hook (bytes as requested).");
  m.def("budget_hook_reset_peak", &pymem::budget_hook_reset_peak);
  m.def("evict_storage", &pymem::evict_storage, py::arg("tensor"),
        "Free the tensor's storage in place (all views and saved tensors see it); returns its bytes.");
  m.def("adopt_storage", &pymem::adopt_storage, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        "Move src's buffer into dst's evicted storage without a copy; dst's _version is unchanged.");
  m.def("storage_is_evicted", &pymem::storage_is_evicted, py::arg("tensor"));
  py::class_<pymem::StorageRef>(m, "StorageRef",
                                "A weak reference to a tensor's storage (its alias pool); see storage.h.")
      .def(py::init<const at::Tensor&>(), py::arg("tensor"))
      .def_property_readonly("alive", &pymem::StorageRef::alive)
      .def_property_readonly("key", &pymem::StorageRef::key)
      .def_property_readonly("nbytes", &pymem::StorageRef::nbytes)
      .def_property_readonly("evicted", &pymem::StorageRef::evicted)
      .def_property_readonly("data_ptr", &pymem::StorageRef::data_ptr)
      .def("evict", &pymem::StorageRef::evict)
      .def("adopt", &pymem::StorageRef::adopt, py::arg("src"))
      .def("relocate", &pymem::StorageRef::relocate, py::arg("addr"),
           "Point the storage at `addr`, where Arena.compact moved its bytes (CPU hook buffers only).")
      .def("view", &pymem::StorageRef::view, py::arg("dtype"), py::arg("size"), py::arg("stride"), py::arg("offset"))
      .def("strong", &pymem::StorageRef::strong);
  m.def("storage_key", &pymem::storage_key, py::arg("tensor"),
        "The tensor's StorageImpl address (its alias-pool key), or 0 without a plain storage.");
  m.def("storage_use_count", &pymem::storage_use_count, py::arg("tensor"),
        "Strong references to the tensor's storage, the tensor's own included (1: only it holds the buffer).");
  m.def("install_interception", &pymem::install_interception,
        "Register pymem's fallback on DispatchKey::Fake (once per process): '' on success, else why not.");
  m.def("interception_installed", &pymem::interception_installed);
  m.def("set_interception_handler", [](py::object handler, const std::string& device) {
    pymem::set_interception_handler(std::move(handler), c10::Device(device).type());
  }, py::arg("handler"), py::arg("device"),
        "handler(func, args, kwargs) runs every op seen with a tensor on `device`'s type (or none); "
        "None: every op passes straight through.");
  m.def("set_interception_included", &pymem::set_included_on_this_thread, py::arg("on"),
        "This thread's ops reach the fallback (or not, False); returns the prior state.");
  m.def("set_interception_excluded", &pymem::set_excluded_on_this_thread, py::arg("on"),
        "This thread's ops bypass the fallback (pymem's own work); returns the prior state.");
  m.def("set_fast_path", &pymem::set_fast_path, py::arg("runtime"),
        "The Runtime whose common ops the interception books in C++ (fast_op.h); None: all in Python.");
  m.def("fast_path_stats", [] {
    const pymem::FastPathStats s = pymem::fast_path_stats();
    py::dict d;
    d["fast"] = s.fast;
    d["slow"] = s.slow;
    return d;
  });
  m.def("movable_blocks", &pymem::movable_blocks, py::arg("table"), py::arg("cache"), py::arg("lo"), py::arg("hi"),
        py::arg("busy"), py::arg("leaf_ok"),
        "{addr: (record, StorageRef, releasable)} for every block of [lo, hi) that may move now (movable.h).");
  m.def("movable_addresses", &pymem::movable_addresses, py::arg("table"), py::arg("cache"), py::arg("lo"),
        py::arg("hi"), py::arg("busy"),
        "The addresses of movable_blocks' blocks alone, as a list (movable.h): the moves-only question's input.");
  m.def("sweep_records", &pymem::sweep_records, py::arg("table"), py::arg("mark_gone"), py::arg("cache"),
        "Runtime.sweep's scan (csrc/sweep.h): drop the records whose storage died; the records left that may be orphaned leaves.");
  m.def("interception_included", &pymem::included_on_this_thread);
  m.def("alias_tensor", &pymem::alias_tensor, py::arg("tensor"),
        "A new tensor sharing the storage and view metadata, outside autograd and the dispatcher.");
#else
  m.attr("HAS_TORCH_HOOK") = false;
#endif
}
