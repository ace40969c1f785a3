// placement.cpp — cheap-tensor partitioning (Coop): where inside the best-fit free block a new block
// goes. Costly blocks take the low-address end, cheap ones the high end, so cheap tensors collect
// next to each other and their windows stay cheap. Either way the free block is reused as one of
// the two halves, so a split costs one new Block.
#include "region.h"

namespace pymem {

Block* Region::place(Block* fb, size_t rounded, CostClass cls) {
  free_.erase(fb);
  free_bytes_ -= rounded;
  if (fb->size == rounded) {
    fb->allocated = true;
    return fb;
  }
  Block* nb = new_block();
  nb->prev = fb;
  nb->next = fb->next;
  if (fb->next) fb->next->prev = nb;
  fb->next = nb;
  if (cls == CostClass::Costly) {  // [allocated fb | free nb]
    nb->addr = fb->addr + rounded;
    nb->size = fb->size - rounded;
    fb->size = rounded;
    fb->allocated = true;
    free_.insert(nb);
    return fb;
  }
  // [free fb | allocated nb]
  nb->size = rounded;
  fb->size -= rounded;
  nb->addr = fb->addr + fb->size;
  nb->allocated = true;
  free_.insert(fb);
  return nb;
}

}  // namespace pymem
