// storage.cpp — see storage.h.
#include "storage.h"

#include "hook_cpu.h"
#include "hook_pluggable.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

namespace pymem {

namespace {
c10::StorageImpl* impl(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "pymem.", what, ": the tensor is undefined");
  TORCH_CHECK(t.has_storage(), "pymem.", what, ": the tensor has no storage (", t.toString(), ")");
  return t.storage().unsafeGetStorageImpl();
}
}  // namespace

// Replacing the DataPtr destroys the old one, which frees the buffer through its deleter.
static size_t evict_impl(c10::StorageImpl* s, const char* what) {
  const size_t n = s->nbytes();
  TORCH_CHECK(n > 0 && s->data_ptr().get() != nullptr, "pymem.", what,
              ": the storage holds no bytes (already evicted, or empty)");
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
  return n;
}

static void adopt_impl(c10::StorageImpl* d, c10::StorageImpl* s, size_t nbytes, const char* what) {
  TORCH_CHECK(d != s, "pymem.", what, ": source and destination share one storage");
  TORCH_CHECK(d->nbytes() == 0 && d->data_ptr().get() == nullptr, "pymem.", what,
              ": the destination storage is not evicted (it holds ", d->nbytes(), " bytes)");
  TORCH_CHECK(s->nbytes() == nbytes, "pymem.", what, ": the recomputed storage holds ", s->nbytes(),
              " bytes, the evicted one held ", nbytes);
  TORCH_CHECK(s->device() == d->device(), "pymem.", what, ": the recomputed storage is on ", s->device(),
              ", the evicted one on ", d->device());
  c10::DataPtr buf = s->set_data_ptr(c10::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
  d->set_data_ptr_noswap(std::move(buf));
  d->set_nbytes(nbytes);
}

size_t evict_storage(const at::Tensor& t) { return evict_impl(impl(t, "evict_storage"), "evict_storage"); }

void adopt_storage(const at::Tensor& dst, const at::Tensor& src, size_t nbytes) {
  adopt_impl(impl(dst, "adopt_storage"), impl(src, "adopt_storage"), nbytes, "adopt_storage");
}

bool storage_is_evicted(const at::Tensor& t) {
  c10::StorageImpl* s = impl(t, "storage_is_evicted");
  return s->nbytes() == 0 && s->data_ptr().get() == nullptr;
}

}  // namespace pymem

#include <ATen/core/TensorBody.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>

namespace pymem {

namespace {
at::Tensor make_view(c10::intrusive_ptr<c10::StorageImpl> s, at::ScalarType dtype, c10::IntArrayRef size,
                     c10::IntArrayRef stride, int64_t offset) {
  const c10::Device dev = s->device();
  c10::DispatchKeySet keys(c10::computeDispatchKey(dtype, c10::kStrided, dev));
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(s)), keys,
                                                    caffe2::TypeMeta::fromScalarType(dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride, offset);
  return t;
}
}  // namespace

StorageRef::StorageRef(const at::Tensor& t)
    : weak_(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl(t, "StorageRef"))),
      key_(reinterpret_cast<uintptr_t>(t.storage().unsafeGetStorageImpl())),
      nbytes_(t.storage().nbytes()) {}

c10::intrusive_ptr<c10::StorageImpl> StorageRef::lock(const char* what) const {
  auto s = weak_.lock();
  TORCH_CHECK(s, "pymem.StorageRef.", what, ": the storage is dead (every tensor of it was freed)");
  return s;
}

bool StorageRef::evicted() const {
  auto s = weak_.lock();
  return s && s->nbytes() == 0 && s->data_ptr().get() == nullptr;
}

uintptr_t StorageRef::data_ptr() const {
  auto s = weak_.lock();
  return s ? reinterpret_cast<uintptr_t>(s->data_ptr().get()) : 0;
}

size_t StorageRef::evict() { return evict_impl(lock("evict").get(), "StorageRef.evict"); }

void StorageRef::adopt(const at::Tensor& src) {
  adopt_impl(lock("adopt").get(), impl(src, "StorageRef.adopt"), nbytes_, "StorageRef.adopt");
}

void StorageRef::relocate(uintptr_t addr) {
  auto s = lock("relocate");
  const c10::DataPtr& old = s->data_ptr();
  TORCH_CHECK(old.get() != nullptr, "pymem.StorageRef.relocate: the storage is evicted");
  if (!is_cpu_hook_buffer(old.get(), old.get_context(), old.get_deleter())) {
    TORCH_CHECK(relocate_pluggable(s.get(), addr),
                "pymem.StorageRef.relocate: the buffer was allocated neither by pymem's CPU hook nor through "
                "pymem's CUDA library, so it cannot be moved");
    return;
  }
  void* p = reinterpret_cast<void*>(addr);
  c10::DataPtr prev = s->set_data_ptr(c10::DataPtr(p, p, old.get_deleter(), old.device()));
  (void)prev.release_context();  // ownership dropped, deleter not run: the old address is no longer ours to free
}

at::Tensor StorageRef::view(at::ScalarType dtype, const std::vector<int64_t>& size,
                            const std::vector<int64_t>& stride, int64_t offset) const {
  TORCH_CHECK(size.size() == stride.size(), "pymem.StorageRef.view: ", size.size(), " sizes but ", stride.size(),
              " strides");
  return make_view(lock("view"), dtype, size, stride, offset);
}

at::Tensor StorageRef::strong() const {
  auto s = lock("strong");
  const int64_t n = static_cast<int64_t>(s->nbytes());
  return make_view(std::move(s), at::kByte, {n}, {1}, 0);
}

uintptr_t storage_key(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return 0;
  return reinterpret_cast<uintptr_t>(t.storage().unsafeGetStorageImpl());
}

size_t storage_use_count(const at::Tensor& t) {
  c10::StorageImpl* s = impl(t, "storage_use_count");
  size_t n = t.storage().use_count();
  // Once Python has seen the storage (untyped_storage()), its Python object lives as long as the
  // storage and holds a reference of its own: when nothing else holds that object, it is not a user.
  if (n > 1 && s->pyobj_slot()->has_unique_reference()) --n;
  return n;
}

at::Tensor alias_tensor(const at::Tensor& t) {
  c10::StorageImpl* s = impl(t, "alias_tensor");
  return make_view(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s), t.scalar_type(), t.sizes(), t.strides(),
                   t.storage_offset());
}

}  // namespace pymem
