// free_index.cpp — see free_index.h.
#include "free_index.h"

namespace pymem {

namespace {
inline size_t ctz(uint64_t x) { return size_t(__builtin_ctzll(x)); }
inline size_t msb(uint64_t x) { return size_t(63 - __builtin_clzll(x)); }
}  // namespace

FreeIndex::FreeIndex() : heaps_(kBins) {}

void FreeIndex::set_bit(size_t bin) {
  bits_[bin / 64] |= uint64_t(1) << (bin % 64);
  summary_[bin / 4096] |= uint64_t(1) << ((bin / 64) % 64);
}

void FreeIndex::clear_bit(size_t bin) {
  uint64_t& w = bits_[bin / 64];
  w &= ~(uint64_t(1) << (bin % 64));
  if (!w) summary_[bin / 4096] &= ~(uint64_t(1) << ((bin / 64) % 64));
}

size_t FreeIndex::first_bin_at_least(size_t bin) const {
  if (bin >= kBins) return kBins;
  size_t w = bin / 64;
  uint64_t m = bits_[w] & (~uint64_t(0) << (bin % 64));
  if (m) return w * 64 + ctz(m);
  ++w;  // next non-empty word, via the summary
  for (size_t s = w / 64; s < kSummaryWords; ++s) {
    uint64_t sm = summary_[s];
    if (s == w / 64) sm &= (w % 64) ? (~uint64_t(0) << (w % 64)) : ~uint64_t(0);
    if (sm) {
      const size_t word = s * 64 + ctz(sm);
      return word * 64 + ctz(bits_[word]);
    }
  }
  return kBins;
}

size_t FreeIndex::last_bin() const {
  for (size_t s = kSummaryWords; s-- > 0;) {
    if (summary_[s]) {
      const size_t word = s * 64 + msb(summary_[s]);
      return word * 64 + msb(bits_[word]);
    }
  }
  return kBins;
}

void FreeIndex::sift_up(std::vector<Block*>& h, size_t i) {
  Block* b = h[i];
  while (i > 0) {
    const size_t p = (i - 1) / 2;
    if (h[p]->addr <= b->addr) break;
    h[i] = h[p];
    h[i]->index_pos = uint32_t(i);
    i = p;
  }
  h[i] = b;
  b->index_pos = uint32_t(i);
}

void FreeIndex::sift_down(std::vector<Block*>& h, size_t i) {
  Block* b = h[i];
  const size_t n = h.size();
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= n) break;
    if (c + 1 < n && h[c + 1]->addr < h[c]->addr) ++c;
    if (b->addr <= h[c]->addr) break;
    h[i] = h[c];
    h[i]->index_pos = uint32_t(i);
    i = c;
  }
  h[i] = b;
  b->index_pos = uint32_t(i);
}

void FreeIndex::insert(Block* b) {
  ++count_;
  if (b->size > kMaxBinned) {
    large_.emplace(std::make_pair(b->size, b->addr), b);
    return;
  }
  const size_t bin = bin_of(b->size);
  std::vector<Block*>& h = heaps_[bin];
  if (h.empty()) set_bit(bin);
  h.push_back(b);
  sift_up(h, h.size() - 1);
}

void FreeIndex::erase(Block* b) {
  --count_;
  if (b->size > kMaxBinned) {
    large_.erase(std::make_pair(b->size, b->addr));
    return;
  }
  const size_t bin = bin_of(b->size);
  std::vector<Block*>& h = heaps_[bin];
  const size_t i = b->index_pos;
  Block* last = h.back();
  h.pop_back();
  if (last != b) {
    h[i] = last;
    last->index_pos = uint32_t(i);
    sift_down(h, i);
    sift_up(h, last->index_pos);
  }
  if (h.empty()) clear_bit(bin);
}

Block* FreeIndex::best_fit(size_t n) const {
  if (n <= kMaxBinned) {
    const size_t bin = first_bin_at_least(bin_of(n));
    if (bin < kBins) return heaps_[bin].front();
  }
  auto it = large_.lower_bound(std::make_pair(n, uintptr_t(0)));
  return it == large_.end() ? nullptr : it->second;
}

template <class Visit>
Block* FreeIndex::find_at_least(size_t n, Visit visit) const {
  if (n <= kMaxBinned)
    for (size_t bin = first_bin_at_least(bin_of(n)); bin < kBins; bin = first_bin_at_least(bin + 1))
      for (Block* b : heaps_[bin])
        if (visit(b)) return b;
  for (auto it = large_.lower_bound(std::make_pair(n, uintptr_t(0))); it != large_.end(); ++it)
    if (visit(it->second)) return it->second;
  return nullptr;
}

Block* FreeIndex::covering(uintptr_t addr, size_t n) const {
  return find_at_least(n, [&](const Block* b) { return b->addr <= addr && addr + n <= b->addr + b->size; });
}

Block* FreeIndex::highest(size_t n) const {
  Block* best = nullptr;
  find_at_least(n, [&](Block* b) {
    if (!best || b->addr > best->addr) best = b;
    return false;
  });
  return best;
}

size_t FreeIndex::largest() const {
  if (!large_.empty()) return large_.rbegin()->first.first;
  const size_t bin = last_bin();
  return bin < kBins ? bin * kAlignment : 0;
}

}  // namespace pymem
