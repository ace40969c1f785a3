// host_pool_py.cpp — pymem._C.HostPool: the host pool (host_pool.h) handing out uint8 CPU tensors
// whose storage goes back to the pool when the tensor dies.
#include "host_pool.h"

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <memory>

namespace py = pybind11;

namespace pymem {

namespace {

py::object host_tensor(const std::shared_ptr<HostPool>& pool, size_t nbytes) {
  void* p = pool->allocate(nbytes);
  if (p == nullptr) return py::none();
  // The deleter may run on any thread, with or without the GIL: it only takes the pool's mutex.
  at::Tensor t = at::from_blob(
      p, {static_cast<int64_t>(nbytes)},
      [pool](void* q) {
        try {
          pool->release(q);
        } catch (...) {  // a deleter must not throw; the pool only refuses addresses it never gave
        }
      },
      at::TensorOptions().dtype(at::kByte));
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t)));
}

}  // namespace

void bind_host_pool(py::module_& m) {  // bindings.cpp calls it
  py::class_<HostPool, std::shared_ptr<HostPool>>(
      m, "HostPool",
      "Host memory for offloaded values (csrc/host_pool.h): chunks of `chunk_bytes`, best fit, "
      "coalescing, an optional cap (`cap_bytes`, 0: none). With `cuda_table` (the address of a CUDA "
      "runtime table) chunks are pinned (cudaHostAlloc) and a block is reused only after the copies "
      "recorded on it (record_use) completed; without, plain host memory.")
      .def(py::init([](size_t chunk_bytes, size_t cap_bytes, uintptr_t cuda_table) {
             if (chunk_bytes == 0) throw py::value_error("pymem: HostPool chunk_bytes must be positive");
             auto source = cuda_table ? make_cuda_host_chunks(reinterpret_cast<const pymem_cuda_table*>(cuda_table))
                                      : make_malloc_chunks();
             return std::make_shared<HostPool>(std::move(source), chunk_bytes, cap_bytes);
           }),
           py::arg("chunk_bytes"), py::arg("cap_bytes") = 0, py::arg("cuda_table") = 0)
      .def(
          "empty", [](const std::shared_ptr<HostPool>& pool, size_t nbytes) { return host_tensor(pool, nbytes); },
          py::arg("nbytes"),
          "A uint8 CPU tensor of `nbytes` from the pool (its storage goes back when it dies); None when "
          "the cap, or the system, refuses.")
      .def(
          "record_use",
          [](HostPool& pool, const at::Tensor& t, uintptr_t stream) {
            pool.record_use(t.storage().mutable_data(), reinterpret_cast<void*>(stream));
          },
          py::arg("tensor"), py::arg("stream") = 0,
          "A copy using the tensor's block was enqueued on `stream` (cudaStream_t as int): the block is "
          "reused only once it completed.")
      .def("fits", &HostPool::fits, py::arg("nbytes"),
           "Whether a block of `nbytes` would be handed out now (under the cap).")
      .def("stats",
           [](const HostPool& pool) {
             const HostPoolStats s = pool.stats();
             py::dict d;
             d["host_bytes"] = s.in_use;
             d["host_bytes.peak"] = s.peak_in_use;
             d["host_reserved_bytes"] = s.reserved;
             d["num_host_chunks"] = s.num_chunks;
             d["num_host_allocs"] = s.num_allocs;
             d["num_host_pending"] = s.num_pending;
             d["num_host_refused"] = s.num_refused;
             return d;
           })
      .def_property_readonly("cap", &HostPool::cap)
      .def_property_readonly("pinned", &HostPool::pinned);
}

}  // namespace pymem
