// storage.h — evict a tensor's storage in place, and adopt a recomputed buffer without a copy.
//
// Evicting empties the StorageImpl (null DataPtr, 0 bytes): every view and every tensor autograd
// saved shares that StorageImpl, so all of them see the eviction and, later, the restore.
// Adopting moves the recomputed result's DataPtr into the evicted StorageImpl: no copy, and the
// tensor's _version is untouched (a copy_ would bump it and autograd would reject the saved tensor).
#pragma once

#include <ATen/core/Tensor.h>

namespace pymem {

// Frees the storage's buffer now. Returns the bytes it held. Throws if the storage does not own
// a plain buffer that can be dropped (already evicted, or 0 bytes).
size_t evict_storage(const at::Tensor& t);
// Moves `src`'s buffer into `dst`'s evicted storage. `nbytes` is what dst held before eviction;
// src's storage must hold exactly that many bytes on the same device. src's storage is left empty.
void adopt_storage(const at::Tensor& dst, const at::Tensor& src, size_t nbytes);
bool storage_is_evicted(const at::Tensor& t);

}  // namespace pymem

#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <vector>

namespace pymem {

// A weak reference to one StorageImpl (an alias pool: a storage and all its views). It keeps the
// StorageImpl object, not its buffer, alive: the buffer is freed the moment the last tensor dies
// (eager eviction for free), and the object's address — the runtime's key — cannot be reused while
// the reference exists, so a stale key can never name a newer storage.
class StorageRef {
 public:
  explicit StorageRef(const at::Tensor& t);
  bool alive() const { return !weak_.expired(); }
  size_t use_count() const { return weak_.use_count(); }  // its holders (storage_use_count's)
  uintptr_t key() const { return key_; }
  size_t nbytes() const { return nbytes_; }  // what the storage held when referenced
  // Alive and holding no buffer.
  bool evicted() const;
  // Address of the buffer (0 when evicted or dead).
  uintptr_t data_ptr() const;
  // Frees the buffer in place (see evict_storage); returns its bytes.
  size_t evict();
  // Moves `src`'s whole storage buffer (exactly nbytes()) into this evicted storage.
  void adopt(const at::Tensor& src);
  // Points the storage at `addr`, where Arena::compact moved its bytes, without freeing the old
  // address (compaction already re-cut the arena). Only for buffers whose DataPtr context is the
  // address itself (the CPU hook's); the deleter is kept, so the new address is freed at death.
  void relocate(uintptr_t addr);
  // A new tensor over this storage with the given view metadata: no dispatcher, no autograd.
  at::Tensor view(at::ScalarType dtype, const std::vector<int64_t>& size, const std::vector<int64_t>& stride,
                  int64_t offset) const;
  // A strong tensor over the whole storage (uint8, 1-D): keeps it alive while held.
  at::Tensor strong() const;

 private:
  c10::intrusive_ptr<c10::StorageImpl> lock(const char* what) const;
  c10::weak_intrusive_ptr<c10::StorageImpl> weak_;
  uintptr_t key_;
  size_t nbytes_;
};

// The StorageImpl address of `t` (the alias-pool key), or 0 when t has no plain storage.
uintptr_t storage_key(const at::Tensor& t);
// How many holders keep the storage of `t` alive: tensors over it (`t` itself is one) and Python
// storage objects someone holds. 1 means nothing but `t` keeps its buffer alive.
size_t storage_use_count(const at::Tensor& t);
// A new TensorImpl sharing t's storage and view metadata, outside autograd and the dispatcher:
// what a recipe holds to keep a non-recomputable input's value.
at::Tensor alias_tensor(const at::Tensor& t);

}  // namespace pymem
