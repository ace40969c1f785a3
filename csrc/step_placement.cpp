// step_placement.cpp — the step's recorded lifetimes, and offsets for the next step (see step_placement.h).
#include "step_placement.h"

#include <algorithm>
#include <functional>
#include <iterator>
#include <numeric>

namespace pymem {

int64_t StepPlacement::planned_offset(size_t rounded) {
  if (diverged_) return -1;
  // The plan's next allocation of this size within kLookahead: a step that ran an allocation more
  // or less (a recompute the step before did not need) keeps its place in the plan.
  const size_t end = std::min(plan_.size(), next_ + kLookahead);
  for (size_t k = next_; k < end; ++k)
    if (plan_size_[k] == rounded) {
      matched_ = k;
      return plan_[k];
    }
  matched_ = SIZE_MAX;
  if (next_ < plan_.size()) diverged_ = true;
  return -1;
}

uint32_t StepPlacement::allocated(size_t rounded) {
  if (matched_ != SIZE_MAX) next_ = matched_ + 1;
  matched_ = SIZE_MAX;
  now_.size.push_back(rounded);
  now_.allocated_at.push_back(clock_++);
  now_.freed_at.push_back(-1);
  return next_serial_++;
}

void StepPlacement::freed(uint32_t serial) {
  if (now_.holds(serial)) now_.freed_at[serial - now_.first_serial] = clock_;
  else if (before_.holds(serial)) before_freed_at_[serial - before_.first_serial] = clock_;
  ++clock_;
}

std::vector<std::pair<size_t, size_t>> StepPlacement::room_for_displaced(size_t region_size) const {
  std::vector<std::pair<size_t, size_t>> room;
  if (matched_ == SIZE_MAX || matched_ >= span_of_.size() || span_of_[matched_] < 0) return room;
  const Span& own = spans_[static_cast<size_t>(span_of_[matched_])];
  size_t cursor = 0;  // spans_ is in offset order (end_step): the gaps between the ones that meet own are its room
  for (const Span& p : spans_) {
    if (p.index == static_cast<int64_t>(matched_) || !p.meets(own.from, own.to)) continue;
    if (p.offset > cursor) room.emplace_back(cursor, p.offset);
    cursor = std::max(cursor, p.offset + p.size);
  }
  if (cursor < region_size) room.emplace_back(cursor, region_size);
  return room;
}

void StepPlacement::set_plan(std::vector<int64_t> offsets, std::vector<size_t> sizes) {
  plan_ = std::move(offsets);
  plan_size_ = std::move(sizes);
  spans_.clear();  // lifetimes not known: a displaced block goes by best fit
  span_of_.clear();
  next_ = 0;
  matched_ = SIZE_MAX;
  diverged_ = false;
}

void StepPlacement::end_step(const std::vector<Live>& live, size_t region_size) {
  std::vector<Span> placed;  // by offset
  placed.reserve(live.size() + now_.size.size());
  for (const Live& l : live) {
    int64_t until = kNever;  // a survivor of this step: freed when its counterpart of the step before was
    if (now_.holds(l.serial)) {
      const size_t k = l.serial - now_.first_serial;
      if (k < before_freed_at_.size() && before_.size[k] == now_.size[k] && before_freed_at_[k] >= 0)
        until = before_freed_at_[k];
    }
    placed.push_back({l.offset, l.size, 0, until, -1});
  }
  std::sort(placed.begin(), placed.end(), [](const Span& a, const Span& b) { return a.offset < b.offset; });

  const size_t n = now_.size.size() <= kMaxPlanned ? now_.size.size() : 0;  // too long a step: no plan
  auto lifetime = [&](size_t k) {
    return std::make_pair(now_.allocated_at[k], now_.freed_at[k] >= 0 ? now_.freed_at[k] : kNever);
  };
  // Each block of `order` at the lowest offset that no block placed before it covers over its
  // lifetime (first fit), or with `best_fit` at the start of the smallest such gap (one no larger
  // than what the region's end leaves: TFLite's greedy by size), into `spans` (in offset order);
  // `plan` gets the offsets. Returns the bytes that fit nowhere (best fit decides those in the
  // next step).
  auto pack = [&](const std::vector<size_t>& order, bool best_fit, std::vector<int64_t>& plan, std::vector<Span>& spans) {
    plan.assign(n, -1);
    size_t left = 0;
    for (const size_t k : order) {
      const size_t size = now_.size[k];
      const auto [from, to] = lifetime(k);
      size_t cursor = 0;  // the lowest offset no block seen so far covers at [from, to)
      size_t at = spans.size();  // where the new span goes in offset order
      size_t best = SIZE_MAX, best_gap = SIZE_MAX, best_at = spans.size();
      for (size_t i = 0; i < spans.size(); ++i) {
        const Span& p = spans[i];
        if (!p.meets(from, to)) continue;
        if (p.offset >= cursor + size) {
          if (!best_fit) {
            at = i;
            break;
          }
          if (p.offset - cursor < best_gap) {
            best = cursor;
            best_gap = p.offset - cursor;
            best_at = i;
          }
        }
        cursor = std::max(cursor, p.offset + p.size);
      }
      if (best_fit && best != SIZE_MAX && (cursor + size > region_size || region_size - cursor >= best_gap)) {
        cursor = best;  // a gap between blocks, no larger than what the region's end leaves
        at = best_at;
      }
      if (cursor + size > region_size) {
        left += size;
        continue;
      }
      plan[k] = static_cast<int64_t>(cursor);
      while (at > 0 && spans[at - 1].offset > cursor) --at;  // keep offset order (at may lie past cursor)
      spans.insert(spans.begin() + at, {cursor, size, from, to, static_cast<int64_t>(k)});
    }
    return left;
  };
  // Largest first, then earliest, each at the lowest offset: the static planners' order (TFLite's,
  // XLA's). Where that leaves blocks without an offset (a tight budget's profile fills the region),
  // another order may pack the same lifetimes whole, and the first that does is kept: a block
  // without an offset lands in a hole of the plan's by best fit and compaction moves what it
  // scattered, step after step (tests/test_step_placement.py). Each of the four orders is tried at
  // the lowest offset, then into the smallest gap that holds each block, and each for up to
  // `passes` passes, the blocks a pass left out going first in the next (a "squeaky wheel": what
  // fits nowhere is placed before what it was left out for; the transformer of
  // bench/plan_ways.py at 0.3 of its peak, 263 blocks filling the region to 0.35 MiB at its
  // peak: no single pass of the eight packs it whole, the second pass of the first does). A
  // partial packing of another order is no surer than the first: kept where it left fewer bytes
  // out, it moved more on two of bench/plan_ways.py's eight budgets.
  const int64_t end = clock_;  // a block that outlives the step lasts to its end, for these orders
  auto span_of = [&](size_t k) {
    const auto [from, to] = lifetime(k);
    return (to == kNever ? end : to) - from;
  };
  using Key = std::function<bool(size_t, size_t)>;
  const Key orders[] = {
      [&](size_t a, size_t b) {  // largest first
        return now_.size[a] != now_.size[b] ? now_.size[a] > now_.size[b] : now_.allocated_at[a] < now_.allocated_at[b];
      },
      [&](size_t a, size_t b) {  // longest lived first: they pin the offsets the rest pack around
        return span_of(a) != span_of(b) ? span_of(a) > span_of(b) : now_.size[a] > now_.size[b];
      },
      [&](size_t a, size_t b) {  // most bytes x clock first
        const double x = static_cast<double>(now_.size[a]) * static_cast<double>(span_of(a));
        const double y = static_cast<double>(now_.size[b]) * static_cast<double>(span_of(b));
        return x != y ? x > y : a < b;
      },
      [&](size_t a, size_t b) { return a < b; },  // in allocation order: stack-like lifetimes nest
  };
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(), orders[0]);
  if (pack(order, false, plan_, placed) > 0) {
    std::vector<Span> obstacles;  // what the step ended with (index -1), in offset order, for the retries
    std::copy_if(placed.begin(), placed.end(), std::back_inserter(obstacles), [](const Span& p) { return p.index < 0; });
    // A pass of the eight orders costs up to 4 n^2 span visits: the extra passes shrink with the
    // step's length (3 up to 591 blocks, 1 at 1,024, none past it: each order once). n > 0 here.
    const size_t passes = 1 + std::min(kMaxExtraPasses, kRetryVisits / (4 * n * n));
    std::vector<int64_t> plan;
    bool whole = false;
    for (const bool best_fit : {false, true})
      for (size_t o = 0; o < std::size(orders) && !whole; ++o) {
        std::sort(order.begin(), order.end(), orders[o]);
        for (size_t pass = 0; pass < passes && !whole; ++pass) {
          if (pass == 0 && o == 0 && !best_fit) {  // the pass made above
            plan = plan_;
            continue;
          }
          if (pass > 0) std::stable_partition(order.begin(), order.end(), [&](size_t k) { return plan[k] < 0; });
          std::vector<Span> spans = obstacles;
          if (pack(order, best_fit, plan, spans) == 0) {
            plan_.swap(plan);
            placed.swap(spans);
            whole = true;
          }
        }
      }
  }
  plan_size_ = n ? now_.size : std::vector<size_t>();
  spans_ = std::move(placed);
  span_of_.assign(n, -1);
  for (size_t i = 0; i < spans_.size(); ++i)
    if (spans_[i].index >= 0) span_of_[static_cast<size_t>(spans_[i].index)] = static_cast<int64_t>(i);
  diverged_ = false;
  next_ = 0;
  matched_ = SIZE_MAX;
  before_ = std::move(now_);
  before_freed_at_.assign(before_.size.size(), -1);
  now_ = Step();
  now_.first_serial = next_serial_;
  clock_ = 0;
}

}  // namespace pymem
