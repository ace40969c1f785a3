// cuda_table.cpp — fills pymem_cuda_table from libcudart at run time.
//
// libpymem_cuda.so never links libcudart: PyTorch's CUDA wheels ship their own copy and a second
// one in the process would be a second runtime. dlopen by soname finds the copy already loaded.
// When the toolkit's headers are at hand (PYMEM_HAVE_CUDA_HEADERS), every table entry is checked at
// compile time against the toolkit's declaration, so a signature drift fails the build instead of
// corrupting a call.
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "cuda_lib.h"
#include "cuda_table.h"

#ifdef PYMEM_HAVE_CUDA_HEADERS
#include <cuda_runtime_api.h>

#include <type_traits>
#endif

namespace pymem {

namespace {

#ifdef PYMEM_HAVE_CUDA_HEADERS
// The table spells CUDA types the ABI-identical C way: cudaError_t -> int, handles -> void*.
template <class T> struct Abi { using type = T; };
template <> struct Abi<cudaError_t> { using type = int; };
template <> struct Abi<cudaStream_t> { using type = void*; };
template <> struct Abi<cudaEvent_t> { using type = void*; };
template <> struct Abi<cudaEvent_t*> { using type = void**; };
template <> struct Abi<cudaMemcpyKind> { using type = int; };

template <class F> struct AbiFn;
template <class R, class... A> struct AbiFn<R (*)(A...)> {
  using type = typename Abi<R>::type (*)(typename Abi<A>::type...);
};
template <class R, class... A> struct AbiFn<R (*)(A...) noexcept> {
  using type = typename Abi<R>::type (*)(typename Abi<A>::type...);
};

static_assert(sizeof(cudaError_t) == sizeof(int), "cudaError_t is returned as int");
static_assert(static_cast<int>(cudaErrorNotReady) == PYMEM_CUDA_ERROR_NOT_READY,
              "PYMEM_CUDA_ERROR_NOT_READY must equal cudaErrorNotReady");
static_assert(cudaEventDisableTiming == 0x02, "cuda_lib.cpp creates events with flag 0x02");
static_assert(static_cast<int>(cudaMemcpyDeviceToDevice) == PYMEM_CUDA_MEMCPY_DEVICE_TO_DEVICE,
              "PYMEM_CUDA_MEMCPY_DEVICE_TO_DEVICE must equal cudaMemcpyDeviceToDevice");

#define PYMEM_CHECK_ENTRY(field, fn)                                                          \
  static_assert(std::is_same<AbiFn<decltype(&fn)>::type, decltype(pymem_cuda_table::field)>::value, \
                "pymem_cuda_table::" #field " does not match " #fn " of the CUDA toolkit")
PYMEM_CHECK_ENTRY(malloc, cudaMalloc);
PYMEM_CHECK_ENTRY(free, cudaFree);
PYMEM_CHECK_ENTRY(get_device, cudaGetDevice);
PYMEM_CHECK_ENTRY(set_device, cudaSetDevice);
PYMEM_CHECK_ENTRY(event_create, cudaEventCreateWithFlags);
PYMEM_CHECK_ENTRY(event_destroy, cudaEventDestroy);
PYMEM_CHECK_ENTRY(event_record, cudaEventRecord);
PYMEM_CHECK_ENTRY(event_query, cudaEventQuery);
PYMEM_CHECK_ENTRY(event_synchronize, cudaEventSynchronize);
PYMEM_CHECK_ENTRY(stream_wait_event, cudaStreamWaitEvent);
PYMEM_CHECK_ENTRY(host_alloc, cudaHostAlloc);
PYMEM_CHECK_ENTRY(free_host, cudaFreeHost);
PYMEM_CHECK_ENTRY(memcpy_async, cudaMemcpyAsync);
#undef PYMEM_CHECK_ENTRY
#endif

// Newest first; the unversioned name last (it only exists where a toolkit is installed).
constexpr const char* kSonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                    "libcudart.so"};

void* open_cudart(std::string* tried) {
  // A runtime already in the process (PyTorch's) wins over a newer one elsewhere on the path.
  for (const char* name : kSonames)
    if (void* h = dlopen(name, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)) return h;
  for (const char* name : kSonames) {
    if (void* h = dlopen(name, RTLD_NOW | RTLD_GLOBAL)) return h;
    const char* e = dlerror();
    *tried += std::string("\n  ") + name + ": " + (e ? e : "not found");
  }
  return nullptr;
}

template <class Fn>
bool bind(void* handle, const char* symbol, Fn* slot, std::string* error) {
  dlerror();
  void* p = dlsym(handle, symbol);
  if (!p) {
    const char* e = dlerror();
    *error = std::string("pymem: libcudart has no symbol ") + symbol + (e ? std::string(": ") + e : "");
    return false;
  }
  *slot = reinterpret_cast<Fn>(p);
  return true;
}

}  // namespace

const pymem_cuda_table* load_cuda_runtime(std::string* error) {
  static std::mutex mutex;
  static pymem_cuda_table table;
  static bool loaded = false;
  std::lock_guard<std::mutex> lock(mutex);
  if (loaded) return &table;

  std::string tried;
  void* h = open_cudart(&tried);
  std::string msg;
  if (!h) {
    msg = "pymem: cannot load the CUDA runtime (libcudart); is a CUDA build of PyTorch imported "
          "and a GPU driver installed? Tried:" + tried;
  } else {
    pymem_cuda_table t{};
    // The handle is never closed: the table's pointers live as long as the process.
    if (bind(h, "cudaMalloc", &t.malloc, &msg) && bind(h, "cudaFree", &t.free, &msg) &&
        bind(h, "cudaGetDevice", &t.get_device, &msg) && bind(h, "cudaSetDevice", &t.set_device, &msg) &&
        bind(h, "cudaEventCreateWithFlags", &t.event_create, &msg) &&
        bind(h, "cudaEventDestroy", &t.event_destroy, &msg) &&
        bind(h, "cudaEventRecord", &t.event_record, &msg) &&
        bind(h, "cudaEventQuery", &t.event_query, &msg) &&
        bind(h, "cudaEventSynchronize", &t.event_synchronize, &msg) &&
        bind(h, "cudaStreamWaitEvent", &t.stream_wait_event, &msg) &&
        bind(h, "cudaHostAlloc", &t.host_alloc, &msg) && bind(h, "cudaFreeHost", &t.free_host, &msg) &&
        bind(h, "cudaMemcpyAsync", &t.memcpy_async, &msg)) {
      table = t;
      loaded = true;
      return &table;
    }
  }
  if (error) *error = msg;
  return nullptr;
}

}  // namespace pymem
