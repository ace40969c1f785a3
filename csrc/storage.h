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
