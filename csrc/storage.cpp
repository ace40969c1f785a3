// storage.cpp — see storage.h.
#include "storage.h"

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

size_t evict_storage(const at::Tensor& t) {
  c10::StorageImpl* s = impl(t, "evict_storage");
  const size_t n = s->nbytes();
  TORCH_CHECK(n > 0 && s->data_ptr().get() != nullptr,
              "pymem.evict_storage: the storage holds no bytes (already evicted, or empty)");
  // Replacing the DataPtr destroys the old one, which frees the buffer through its deleter.
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
  return n;
}

void adopt_storage(const at::Tensor& dst, const at::Tensor& src, size_t nbytes) {
  c10::StorageImpl* d = impl(dst, "adopt_storage");
  c10::StorageImpl* s = impl(src, "adopt_storage");
  TORCH_CHECK(d != s, "pymem.adopt_storage: source and destination share one storage");
  TORCH_CHECK(d->nbytes() == 0 && d->data_ptr().get() == nullptr,
              "pymem.adopt_storage: the destination storage is not evicted (it holds ", d->nbytes(), " bytes)");
  TORCH_CHECK(s->nbytes() == nbytes, "pymem.adopt_storage: the recomputed storage holds ", s->nbytes(),
              " bytes, the evicted one held ", nbytes);
  TORCH_CHECK(s->device() == d->device(), "pymem.adopt_storage: the recomputed storage is on ", s->device(),
              ", the evicted one on ", d->device());
  c10::DataPtr buf = s->set_data_ptr(c10::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
  d->set_data_ptr_noswap(std::move(buf));
  d->set_nbytes(nbytes);
}

bool storage_is_evicted(const at::Tensor& t) {
  c10::StorageImpl* s = impl(t, "storage_is_evicted");
  return s->nbytes() == 0 && s->data_ptr().get() == nullptr;
}

}  // namespace pymem
