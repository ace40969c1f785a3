// plan_cover.cpp — the overflow cover (see plan_cover.h).
#include "plan_cover.h"

#include "types.h"

#include <algorithm>
#include <queue>

namespace pymem {
namespace {

constexpr double kNever = 1e30;  // the cost of needing a value that cannot come back
constexpr double kMinCost = 1e-9;
constexpr int kMaxLineage = 64;
// The cover stops scoring and picking after this much work (positions summed, records walked:
// about half a second);
// the pressure handler releases what it left over. Lazy greedy re-scores a few candidates per
// pick, but a long step with a long overflow still costs picks x positions.
constexpr int64_t kMaxWork = int64_t{100} << 20;

// Value -> ascending int32 list, in one array (CSR).
struct Lists {
  std::vector<int64_t> start;
  std::vector<int32_t> items;
  const int32_t* begin(size_t v) const { return items.data() + start[v]; }
  const int32_t* end(size_t v) const { return items.data() + start[v + 1]; }
};

template <class Each>
Lists lists_of(size_t m, Each each) {  // each(emit): emit(v, item) for every pair, items ascending per v
  Lists l;
  l.start.assign(m + 1, 0);
  each([&](int32_t v, int32_t) { ++l.start[static_cast<size_t>(v) + 1]; });
  for (size_t v = 0; v < m; ++v) l.start[v + 1] += l.start[v];
  l.items.resize(static_cast<size_t>(l.start[m]));
  std::vector<int64_t> fill(l.start.begin(), l.start.end() - 1);
  each([&](int32_t v, int32_t x) { l.items[static_cast<size_t>(fill[static_cast<size_t>(v)]++)] = x; });
  return l;
}

struct Candidate {
  int32_t value, after, until;  // away after op `after`, back for op `until`
};

class Cover {
 public:
  Cover(const StepArrays& s, int64_t budget) : s_(s), n_(s.op.size()), m_(s.value_bytes.size()) {
    uses_ = lists_of(m_, [&](auto emit) {
      for (size_t k = 0; k < n_; ++k)
        for (int64_t i = s.inputs_start[k]; i < s.inputs_start[k + 1]; ++i) emit(s.inputs[static_cast<size_t>(i)], static_cast<int32_t>(k));
    });
    // The profile first: a step that never overflows needs nothing else.
    size_.resize(m_);
    last_.assign(m_, -1);
    death_.assign(m_, -1);
    std::vector<int64_t> delta(n_ + 1, 0);
    const bool deaths = !s.value_free_at.empty();
    for (size_t v = 0; v < m_; ++v) {
      size_[v] = static_cast<int64_t>(align_up(static_cast<size_t>(s.value_bytes[v])));
      if (uses_.begin(v) != uses_.end(v)) last_[v] = *(uses_.end(v) - 1);
      const int32_t p = s.value_producer[v];
      // It holds its bytes until its storage dies (after its last use: autograd frees a backward
      // temporary when its node ends; alive at the end: the whole step), or, where deaths were not
      // observed, until its last use.
      const int32_t died = !deaths ? last_[v] : s.value_free_at[v] < 0 ? static_cast<int32_t>(n_) - 1 : s.value_free_at[v];
      death_[v] = p < 0 ? static_cast<int32_t>(n_) - 1 : std::max({last_[v], p, died});
      const size_t from = p < 0 ? 0 : static_cast<size_t>(p);
      const size_t to = static_cast<size_t>(death_[v]) + 1;
      delta[from] += size_[v];
      delta[to] -= size_[v];
    }
    over_.assign(n_, 0);
    next_over_.resize(n_ + 1);
    int64_t live = 0;
    for (size_t k = 0; k < n_; ++k) {
      live += delta[k];
      over_[k] = std::max<int64_t>(live - budget, 0);
      excess_ += over_[k];
      next_over_[k] = over_[k] > 0 ? static_cast<int32_t>(k) : static_cast<int32_t>(k + 1);
    }
    next_over_[n_] = static_cast<int32_t>(n_);
    if (excess_ == 0) return;
    // A value's inputs: its producer's, each once (itself left out: an in-place op reads what it
    // writes). An op's distinct inputs are found once and shared by its outputs (foreach ops have
    // thousands of each).
    std::vector<int32_t> distinct;
    std::vector<uint32_t> mark(m_, 0);
    uint32_t op_mark = 0;
    std::vector<std::vector<int32_t>> op_inputs_of(n_);  // only for ops that made values
    for (size_t v = 0; v < m_; ++v) {
      const int32_t p = s.value_producer[v];
      if (p < 0 || !op_inputs_of[static_cast<size_t>(p)].empty()) continue;
      ++op_mark;
      auto& d = op_inputs_of[static_cast<size_t>(p)];
      for (int64_t i = s.inputs_start[static_cast<size_t>(p)]; i < s.inputs_start[static_cast<size_t>(p) + 1]; ++i) {
        const int32_t w = s.inputs[static_cast<size_t>(i)];
        if (mark[static_cast<size_t>(w)] != op_mark) {
          mark[static_cast<size_t>(w)] = op_mark;
          d.push_back(w);
        }
      }
    }
    inputs_ = lists_of(m_, [&](auto emit) {
      for (size_t v = 0; v < m_; ++v) {
        const int32_t p = s.value_producer[v];
        if (p < 0) continue;
        for (int32_t w : op_inputs_of[static_cast<size_t>(p)])
          if (w != static_cast<int32_t>(v)) emit(static_cast<int32_t>(v), w);
      }
    });
    readers_ = lists_of(m_, [&](auto emit) {
      for (size_t v = 0; v < m_; ++v)
        for (const int32_t* w = inputs_.begin(v); w != inputs_.end(v); ++w) emit(*w, static_cast<int32_t>(v));
    });
    away_.resize(m_);
    seen_.assign(m_, 0);
  }

  std::vector<std::pair<int32_t, int32_t>> run() {
    std::vector<std::pair<int32_t, int32_t>> due;
    if (excess_ == 0) return due;
    std::vector<Candidate> cands;
    for (size_t v = 0; v < m_; ++v) {
      const int32_t p = s_.value_producer[v];
      if (p < 0 || !s_.value_recomputable[v]) continue;
      int32_t prev = p;
      for (const int32_t* u = uses_.begin(v); u != uses_.end(v); ++u) {
        if (*u - prev >= 2) cands.push_back({static_cast<int32_t>(v), prev, *u});
        prev = std::max(prev, *u);
      }
      // Held past its last use: released there, it never comes back (its tail costs nothing).
      if (death_[v] > prev) cands.push_back({static_cast<int32_t>(v), prev, death_[v] + 1});
    }
    using Entry = std::pair<double, size_t>;  // (an upper bound of the ratio, candidate)
    std::priority_queue<Entry> queue;
    for (size_t i = 0; i < cands.size() && work_ < kMaxWork; ++i) {
      const double r = ratio(cands[i]);
      if (r > 0) queue.emplace(r, i);
    }
    while (excess_ > 0 && !queue.empty() && work_ < kMaxWork) {
      const size_t i = queue.top().second;
      queue.pop();
      const double r = ratio(cands[i]);
      if (r <= 0) continue;
      if (!queue.empty() && r < queue.top().first) {  // another may be better now: re-queue
        queue.emplace(r, i);
        continue;
      }
      take(cands[i]);
      due.emplace_back(cands[i].after, cands[i].value);
    }
    return due;
  }

 private:
  // The first position at or after k still over the budget (n when none): a union-find over the
  // positions the picks brought down to the budget, so coverage sums skip them.
  int32_t next_over(int32_t k) {
    int32_t root = k;
    while (next_over_[static_cast<size_t>(root)] != root) root = next_over_[static_cast<size_t>(root)];
    while (next_over_[static_cast<size_t>(k)] != root) {
      const int32_t up = next_over_[static_cast<size_t>(k)];
      next_over_[static_cast<size_t>(k)] = root;
      k = up;
    }
    return root;
  }

  bool away_at(int32_t w, int32_t t) const {
    const auto uw = static_cast<size_t>(w);
    if (s_.value_producer[uw] < 0) return false;  // made before the step: kept (a leaf)
    if (t > death_[uw]) return true;               // dead by then: a recompute that reads it makes it again
    for (const auto& [a, b] : away_[uw])
      if (a < t && t <= b) return true;
    return false;
  }

  // The work of recomputing v for op t: its producer, and every input away then, once each (at
  // most kMaxLineage of them, as the runtime's a*: deeper lineages are dear enough already).
  double lineage(int32_t v, int32_t t) {
    ++stamp_;
    double total = 0;
    stack_.assign(1, v);
    seen_[static_cast<size_t>(v)] = stamp_;
    for (int walked = 0; !stack_.empty() && walked < kMaxLineage; ++walked) {
      ++work_;
      const auto x = static_cast<size_t>(stack_.back());
      stack_.pop_back();
      if (!s_.value_recomputable[x]) return kNever;
      total += s_.op_cost[static_cast<size_t>(s_.value_producer[x])];
      for (const int32_t* w = inputs_.begin(x); w != inputs_.end(x); ++w) {
        if (seen_[static_cast<size_t>(*w)] == stamp_ || !away_at(*w, t)) continue;
        seen_[static_cast<size_t>(*w)] = stamp_;
        stack_.push_back(*w);
      }
    }
    return total;
  }

  double ratio(const Candidate& c) {
    const int64_t bytes = size_[static_cast<size_t>(c.value)];
    double gain = 0;
    for (int32_t k = next_over(c.after + 1); k < c.until; k = next_over(k + 1), ++work_)
      gain += static_cast<double>(std::min(bytes, over_[static_cast<size_t>(k)]));
    if (gain <= 0) return 0;
    // A tail (away past the last use) needs no comeback.
    double cost = c.until > last_[static_cast<size_t>(c.value)] ? 0 : lineage(c.value, c.until);
    // Picks already made whose recompute falls in this gap read it then: they pay for it too.
    const auto v = static_cast<size_t>(c.value);
    for (const int32_t* x = readers_.begin(v); x != readers_.end(v) && cost < kNever; ++x)
      for (const auto& [a, b] : away_[static_cast<size_t>(*x)])
        if (c.after < b && b < c.until) cost += lineage(c.value, b);  // at `until` v is back anyway
    return cost >= kNever ? 0 : gain / std::max(cost, kMinCost);
  }

  void take(const Candidate& c) {
    const int64_t bytes = size_[static_cast<size_t>(c.value)];
    away_[static_cast<size_t>(c.value)].emplace_back(c.after, c.until);
    for (int32_t k = next_over(c.after + 1); k < c.until; k = next_over(k + 1)) {
      int64_t& o = over_[static_cast<size_t>(k)];
      const int64_t cut = std::min(bytes, o);
      o -= cut;
      excess_ -= cut;
      if (o == 0) next_over_[static_cast<size_t>(k)] = k + 1;
    }
  }

  const StepArrays& s_;
  const size_t n_, m_;
  Lists uses_, inputs_, readers_;
  std::vector<int64_t> size_;
  std::vector<int32_t> last_;   // a value's last use (-1: none)
  std::vector<int32_t> death_;  // the op after which it no longer holds its bytes (n - 1: the end)
  std::vector<int64_t> over_;   // bytes over the budget at each position, what the picks leave
  std::vector<int32_t> next_over_;  // next_over()'s links (a root: over, or n)
  int64_t excess_ = 0;          // their sum
  std::vector<std::vector<std::pair<int32_t, int32_t>>> away_;  // the picks, by value
  std::vector<uint32_t> seen_;  // lineage walks' marks
  uint32_t stamp_ = 0;
  std::vector<int32_t> stack_;  // lineage walks'
  int64_t work_ = 0;            // coverage positions and lineage records visited
};

}  // namespace

std::vector<std::pair<int32_t, int32_t>> cover_releases(const StepArrays& s, int64_t budget) {
  if (s.op.empty() || budget <= 0) return {};
  return Cover(s, budget).run();
}

double comeback_cost(const StepArrays& s) {
  double total = 0;
  for (int32_t v : s.back_value)
    if (v >= 0 && static_cast<size_t>(v) < s.value_producer.size()) {
      const int32_t p = s.value_producer[static_cast<size_t>(v)];
      if (p >= 0 && static_cast<size_t>(p) < s.op_cost.size()) total += s.op_cost[static_cast<size_t>(p)];
    }
  return total;
}

}  // namespace pymem
