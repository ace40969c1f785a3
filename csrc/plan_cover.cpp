// plan_cover.cpp — the overflow covers (see plan_cover.h).
#include "plan_cover.h"

#include "types.h"

#include <algorithm>
#include <queue>
#include <set>

namespace pymem {
namespace {

constexpr double kNever = 1e30;  // the cost of needing a value that cannot come back
constexpr double kMinCost = 1e-9;
constexpr int kMaxLineage = 64;
// The budgets cover_releases plans for, as shares of the real one (see there).
constexpr double kCoverBudgets[] = {1.0, 0.98, 0.96};
// A pick is dropped (prune) only where this share of the budget stays free across its gap without
// it: the slack placement needs. With none, rebuild at the transformer's checkpointed peak
// (bench/plan_ways.py, measured costs) moved 22-110 MiB a step in compactions instead of 8.
constexpr double kPruneSlack = 0.03;
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

// What both covers start from: the step's uses, its values' aligned sizes, last uses and deaths,
// the live bytes at each position, and (only where that overflows) each value's inputs.
struct Profile {
  size_t n, m;
  Lists uses, inputs;
  std::vector<int64_t> size, live;
  std::vector<int32_t> last;   // a value's last use (-1: none)
  std::vector<int32_t> death;  // the op after which it no longer holds its bytes (n - 1: the end)
  int64_t excess = 0;          // bytes over the budget, summed over positions

  Profile(const StepArrays& s, int64_t budget) : n(s.op.size()), m(s.value_bytes.size()) {
    uses = lists_of(m, [&](auto emit) {
      for (size_t k = 0; k < n; ++k)
        for (int64_t i = s.inputs_start[k]; i < s.inputs_start[k + 1]; ++i) emit(s.inputs[static_cast<size_t>(i)], static_cast<int32_t>(k));
    });
    size.resize(m);
    last.assign(m, -1);
    death.assign(m, -1);
    std::vector<int64_t> delta(n + 1, 0);
    const bool deaths = !s.value_free_at.empty();
    for (size_t v = 0; v < m; ++v) {
      size[v] = static_cast<int64_t>(align_up(static_cast<size_t>(s.value_bytes[v])));
      if (uses.begin(v) != uses.end(v)) last[v] = *(uses.end(v) - 1);
      const int32_t p = s.value_producer[v];
      // It holds its bytes until its storage dies (after its last use: autograd frees a backward
      // temporary when its node ends; alive at the end: the whole step), or, where deaths were not
      // observed, until its last use.
      const int32_t died = !deaths ? last[v] : s.value_free_at[v] < 0 ? static_cast<int32_t>(n) - 1 : s.value_free_at[v];
      death[v] = p < 0 ? static_cast<int32_t>(n) - 1 : std::max({last[v], p, died});
      delta[p < 0 ? 0 : static_cast<size_t>(p)] += size[v];
      delta[static_cast<size_t>(death[v]) + 1] -= size[v];
    }
    live.assign(n, 0);
    int64_t bytes = 0;
    const bool transients = !s.op_transient.empty();
    for (size_t k = 0; k < n; ++k) {
      bytes += delta[k];
      // An op's temporaries are there only while it runs: they count at its own position.
      live[k] = bytes + (transients ? s.op_transient[k] : 0);
      excess += std::max<int64_t>(live[k] - budget, 0);
    }
    if (excess == 0) return;  // a step that never overflows needs nothing else
    // A value's inputs: its producer's, each once (itself left out: an in-place op reads what it
    // writes), less the one it overwrote unread (value_blank_rerun: a dropout mask's rerun needs
    // no activation back; counted read, the mask's rerun at 0.3 of the transformer's peak replayed
    // the whole MLP chain, which the runtime does not). An op's distinct inputs are found once and
    // shared by its outputs (foreach ops have thousands of each).
    std::vector<uint32_t> mark(m, 0);
    uint32_t op_mark = 0;
    std::vector<std::vector<int32_t>> op_inputs_of(n);  // only for ops that made values
    for (size_t v = 0; v < m; ++v) {
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
    inputs = lists_of(m, [&](auto emit) {
      for (size_t v = 0; v < m; ++v) {
        const int32_t p = s.value_producer[v];
        if (p < 0) continue;
        const int32_t blank = s.value_blank_rerun.empty() || !s.value_blank_rerun[v] ? -1 : s.value_overwrites[v];
        for (int32_t w : op_inputs_of[static_cast<size_t>(p)])
          if (w != static_cast<int32_t>(v) && w != blank) emit(static_cast<int32_t>(v), w);
      }
    });
  }
};

// The candidates of a step: each recomputable value made in it, away across each gap between its
// uses (or its producer and first use), and, held past its last use, its tail (released there, it
// never comes back: it costs nothing).
template <class Emit>
void candidates_of(const StepArrays& s, const Profile& p, Emit emit) {
  for (size_t v = 0; v < p.m; ++v) {
    const int32_t made = s.value_producer[v];
    if (made < 0 || !s.value_recomputable[v]) continue;
    int32_t prev = made;
    for (const int32_t* u = p.uses.begin(v); u != p.uses.end(v); ++u) {
      if (*u - prev >= 2) emit(static_cast<int32_t>(v), prev, *u);
      prev = std::max(prev, *u);
    }
    if (p.death[v] > prev) emit(static_cast<int32_t>(v), prev, p.death[v] + 1);
  }
}

struct Candidate {
  int32_t value, after, until;  // away after op `after`, back for op `until`
};

// The cover that prices each comeback with its lineage: inputs away or dead then are rerun too,
// and are counted away still afterwards (the runtime keeps what it rebuilt, until pressure).
class LineageCover {
 public:
  LineageCover(const StepArrays& s, const Profile& p, int64_t budget) : s_(s), p_(p), n_(p.n), m_(p.m), budget_(budget) {
    if (p.excess == 0) return;
    over_.resize(n_);
    next_over_.resize(n_ + 1);
    for (size_t k = 0; k < n_; ++k) {
      over_[k] = std::max<int64_t>(p.live[k] - budget, 0);
      excess_ += over_[k];  // `budget` may be below the profile's: a tighter cover (cover_releases)
      next_over_[k] = over_[k] > 0 ? static_cast<int32_t>(k) : static_cast<int32_t>(k + 1);
    }
    next_over_[n_] = static_cast<int32_t>(n_);
    readers_ = lists_of(m_, [&](auto emit) {
      for (size_t v = 0; v < m_; ++v)
        for (const int32_t* w = p.inputs.begin(v); w != p.inputs.end(v); ++w) emit(*w, static_cast<int32_t>(v));
    });
    away_.resize(m_);
    seen_.assign(m_, 0);
  }

  std::vector<std::pair<int32_t, int32_t>> run() {
    std::vector<std::pair<int32_t, int32_t>> due;
    if (excess_ == 0) return due;
    std::vector<Candidate> cands;
    candidates_of(s_, p_, [&](int32_t v, int32_t after, int32_t until) { cands.push_back({v, after, until}); });
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
    }
    prune();
    for (size_t v = 0; v < m_; ++v)
      for (const auto& [a, b] : away_[v]) due.emplace_back(a, static_cast<int32_t>(v));
    std::sort(due.begin(), due.end());
    return due;
  }

  // The work of the comebacks run() planned, each priced with the lineage the picks left (a
  // tail: none). The picks' own prices were taken before later picks; this is the whole plan's.
  int64_t work() const { return work_; }

  double planned_cost() {
    double total = 0;
    for (size_t v = 0; v < m_ && total < kNever; ++v)
      for (const auto& [a, b] : away_[v])
        if (b <= p_.last[v]) total += lineage(static_cast<int32_t>(v), b);
    return total;
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
    if (t > p_.death[uw]) return true;               // dead by then: a recompute that reads it makes it again
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
      for (const int32_t* w = p_.inputs.begin(x); w != p_.inputs.end(x); ++w) {
        if (seen_[static_cast<size_t>(*w)] == stamp_ || !away_at(*w, t)) continue;
        seen_[static_cast<size_t>(*w)] = stamp_;
        stack_.push_back(*w);
      }
    }
    return total;
  }

  double ratio(const Candidate& c) {
    const int64_t bytes = p_.size[static_cast<size_t>(c.value)];
    double gain = 0;
    for (int32_t k = next_over(c.after + 1); k < c.until; k = next_over(k + 1), ++work_)
      gain += static_cast<double>(std::min(bytes, over_[static_cast<size_t>(k)]));
    if (gain <= 0) return 0;
    // A tail (away past the last use) needs no comeback.
    double cost = c.until > p_.last[static_cast<size_t>(c.value)] ? 0 : lineage(c.value, c.until);
    // Picks already made whose recompute falls in this gap read it then: they pay for it too.
    const auto v = static_cast<size_t>(c.value);
    for (const int32_t* x = readers_.begin(v); x != readers_.end(v) && cost < kNever; ++x)
      for (const auto& [a, b] : away_[static_cast<size_t>(*x)])
        if (c.after < b && b < c.until) cost += lineage(c.value, b);  // at `until` v is back anyway
    return cost >= kNever ? 0 : gain / std::max(cost, kMinCost);
  }

  void take(const Candidate& c) {
    const int64_t bytes = p_.size[static_cast<size_t>(c.value)];
    away_[static_cast<size_t>(c.value)].emplace_back(c.after, c.until);
    for (int32_t k = next_over(c.after + 1); k < c.until; k = next_over(k + 1)) {
      int64_t& o = over_[static_cast<size_t>(k)];
      const int64_t cut = std::min(bytes, o);
      o -= cut;
      excess_ -= cut;
      if (o == 0) next_over_[static_cast<size_t>(k)] = k + 1;
    }
  }

  // Greedy keeps every pick, though later picks may have covered an earlier one's overflow: each
  // pick that brings a value back, dearest first, is dropped where the live bytes stay within the
  // budget less kPruneSlack across its gap without it (its value then stays, and picks whose
  // reruns read it there cost less).
  void prune() {
    std::vector<int64_t> held(n_ + 1, 0);  // live bytes at each position, less the picks'
    for (size_t k = 0; k < n_; ++k) held[k] += p_.live[k];
    struct Pick { double cost; int32_t value, after, until; };
    std::vector<Pick> picks;
    for (size_t v = 0; v < m_; ++v)
      for (const auto& [a, b] : away_[v]) {
        for (int32_t k = a + 1; k < std::min<int32_t>(b, static_cast<int32_t>(n_)); ++k) held[static_cast<size_t>(k)] -= p_.size[v];
        if (b <= p_.last[v]) picks.push_back({lineage(static_cast<int32_t>(v), b), static_cast<int32_t>(v), a, b});
      }
    std::stable_sort(picks.begin(), picks.end(), [](const Pick& x, const Pick& y) { return x.cost > y.cost; });
    const auto room = static_cast<int64_t>(static_cast<double>(budget_) * (1.0 - kPruneSlack));
    for (const Pick& pk : picks) {
      if (work_ >= kMaxWork) break;
      const int64_t bytes = p_.size[static_cast<size_t>(pk.value)];
      bool fits = true;
      for (int32_t k = pk.after + 1; k < pk.until && fits; ++k, ++work_) fits = held[static_cast<size_t>(k)] + bytes <= room;
      if (!fits) continue;
      for (int32_t k = pk.after + 1; k < pk.until; ++k) held[static_cast<size_t>(k)] += bytes;
      auto& away = away_[static_cast<size_t>(pk.value)];
      away.erase(std::find(away.begin(), away.end(), std::make_pair(pk.after, pk.until)));
    }
  }

  const StepArrays& s_;
  const Profile& p_;
  const size_t n_, m_;
  const int64_t budget_;
  Lists readers_;
  std::vector<int64_t> over_;   // bytes over the budget at each position, what the picks leave
  std::vector<int32_t> next_over_;  // next_over()'s links (a root: over, or n)
  int64_t excess_ = 0;          // their sum
  std::vector<std::vector<std::pair<int32_t, int32_t>>> away_;  // the picks, by value
  std::vector<uint32_t> seen_;  // lineage walks' marks
  uint32_t stamp_ = 0;
  std::vector<int32_t> stack_;  // lineage walks'
  int64_t work_ = 0;            // coverage positions and lineage records visited
};

// One stretch a value is away: released after op `after`, back for op `until` (rerun there), or,
// a tail, never needed again (`until` is past its death).
struct Away {
  int32_t after, until;
  bool tail;
};

// The cover that plans what a rerun rebuilds: kept where it fits, released again where not.
class RebuildCover {
 public:
  RebuildCover(const StepArrays& s, const Profile& p, int64_t budget)
      : s_(s), p_(p), n_(p.n), m_(p.m), budget_(budget), live_(p.live), excess_(p.excess) {
    if (excess_ == 0) return;
    for (size_t k = 0; k < n_; ++k)
      if (live_[k] > budget_) overs_.insert(overs_.end(), static_cast<int32_t>(k));
    away_.resize(m_);
    needs_.resize(m_);
    seen_.assign(m_, 0);
  }

  std::vector<std::pair<int32_t, int32_t>> run() {
    std::vector<std::pair<int32_t, int32_t>> due;
    if (excess_ == 0) return due;
    candidates_of(s_, p_, [&](int32_t v, int32_t after, int32_t until) { cands_.push_back({v, after, until}); });
    for (size_t i = 0; i < cands_.size() && work_ < kMaxWork; ++i) offer(i);
    // Picks bring back what a rerun reads, so the overflow may grow again where they do; a
    // candidate that covered nothing waits (`idle_`) until then. A candidate is taken once, and
    // those a pick adds are later parts of stretches already taken, so this ends; the work limit
    // bounds it sooner on long steps.
    while (excess_ > 0 && !queue_.empty() && work_ < kMaxWork) {
      const size_t i = queue_.top().second;
      queue_.pop();
      const Score sc = score(cands_[i]);
      if (sc.ratio <= 0) {
        idle_.push_back(i);
        continue;
      }
      if (!queue_.empty() && sc.ratio < queue_.top().first) {  // another may be better now: re-queue
        queue_.emplace(sc.ratio, i);
        continue;
      }
      take(cands_[i], sc.whole);
    }
    prune();
    for (size_t v = 0; v < m_; ++v)
      for (const Away& a : away_[v])
        if (a.until - a.after >= 2) due.emplace_back(a.after, static_cast<int32_t>(v));
    std::sort(due.begin(), due.end());
    return due;
  }

 private:
  int64_t over_at(size_t k) const { return std::max<int64_t>(live_[k] - budget_, 0); }

  // As LineageCover::prune: a stretch that brings its value back, dearest rerun first, is dropped
  // where the live bytes stay within the budget less kPruneSlack across it without it. What its
  // rerun rebuilt stays counted (live_ only overstates then: a check that may keep a stretch, never
  // drop a needed one).
  void prune() {
    if (excess_ > 0) return;  // a cover cut short (work limit, overflow nothing covers): as greedy left it
    struct Pick { double cost; int32_t value; size_t index; };
    std::vector<Pick> picks;
    for (size_t v = 0; v < m_; ++v)
      for (size_t i = 0; i < away_[v].size(); ++i) {
        const Away& a = away_[v][i];
        if (a.tail || a.until - a.after < 2 || a.until >= static_cast<int32_t>(n_)) continue;
        const double cost = s_.op_cost[static_cast<size_t>(s_.value_producer[v])] + rerun_inputs(static_cast<int32_t>(v), a.until, false, nullptr);
        picks.push_back({cost, static_cast<int32_t>(v), i});
      }
    std::stable_sort(picks.begin(), picks.end(), [](const Pick& x, const Pick& y) { return x.cost > y.cost; });
    const auto room = static_cast<int64_t>(static_cast<double>(budget_) * (1.0 - kPruneSlack));
    std::vector<std::vector<uint8_t>> dropped(m_);
    for (const Pick& pk : picks) {
      if (work_ >= kMaxWork) break;
      const auto v = static_cast<size_t>(pk.value);
      const Away& a = away_[v][pk.index];
      const int64_t bytes = p_.size[v];
      bool fits = true;
      for (int32_t k = a.after + 1; k < a.until && fits; ++k, ++work_) fits = live_[static_cast<size_t>(k)] + bytes <= room;
      if (!fits) continue;
      add_live(a.after + 1, a.until, bytes);
      if (dropped[v].empty()) dropped[v].assign(away_[v].size(), 0);
      dropped[v][pk.index] = 1;
    }
    for (size_t v = 0; v < m_; ++v) {
      if (dropped[v].empty()) continue;
      std::vector<Away> kept;
      for (size_t i = 0; i < away_[v].size(); ++i)
        if (!dropped[v][i]) kept.push_back(away_[v][i]);
      away_[v] = std::move(kept);
    }
  }

  // Adds `bytes` (negative: removes) to the live bytes at positions [from, to).
  void add_live(int32_t from, int32_t to, int64_t bytes) {
    for (int32_t k = from; k < to; ++k, ++work_) {
      const auto uk = static_cast<size_t>(k);
      const int64_t before = over_at(uk);
      live_[uk] += bytes;
      const int64_t after = over_at(uk);
      excess_ += after - before;
      if (before == 0 && after > 0) overs_.insert(k);
      if (before > 0 && after == 0) overs_.erase(k);
    }
  }

  // How much more the step overflows with `bytes` more live at [from, to).
  int64_t overflow_added(int32_t from, int32_t to, int64_t bytes) {
    int64_t added = 0;
    for (int32_t k = from; k < to; ++k, ++work_) {
      const auto uk = static_cast<size_t>(k);
      added += std::max<int64_t>(live_[uk] + bytes - budget_, 0) - over_at(uk);
    }
    return added;
  }

  // The away stretch of v that op t falls in (-1: none): v is not there for t.
  int away_stretch(int32_t v, int32_t t) const {
    const auto& stretches = away_[static_cast<size_t>(v)];
    for (size_t i = 0; i < stretches.size(); ++i)
      if (stretches[i].after < t && t < stretches[i].until) return static_cast<int>(i);
    return -1;
  }

  // Rerunning v's producer for op t: what its inputs need then, walked as the runtime's restore
  // replays them (at most kMaxLineage reruns: deeper lineages are dear enough already). An input
  // made before the step, or there at t, is read where it is (a later stretch of it must end by
  // t: `needs_`). A dead one is rerun for this op only. One away is rerun too; then, where its
  // bytes fit until it was due back, it stays (its stretch ends at t: the runtime keeps what it
  // rebuilt), else it goes again after t, and comes back when it was due as well. Returns the
  // work of the reruns (kNever: something needed cannot come back) and adds to
  // `extra_overflow` the overflow they bring back; `commit` makes the cuts.
  double rerun_inputs(int32_t v, int32_t t, bool commit, int64_t* extra_overflow) {
    ++stamp_;
    double total = 0;
    jobs_.assign(1, v);
    seen_[static_cast<size_t>(v)] = stamp_;
    for (size_t j = 0; j < jobs_.size() && j < static_cast<size_t>(kMaxLineage); ++j) {
      const auto x = static_cast<size_t>(jobs_[j]);
      for (const int32_t* in = p_.inputs.begin(x); in != p_.inputs.end(x); ++in) {
        ++work_;
        const int32_t w = *in;
        const auto uw = static_cast<size_t>(w);
        if (seen_[uw] == stamp_) continue;
        seen_[uw] = stamp_;
        const int32_t p = s_.value_producer[uw];
        if (p < 0) continue;
        if (t > p_.death[uw]) {
          if (!s_.value_recomputable[uw]) return kNever;
          total += s_.op_cost[static_cast<size_t>(p)];
          jobs_.push_back(w);
          continue;
        }
        const int i = away_stretch(w, t);
        if (i < 0) {
          if (commit) insert_need(w, t);
          continue;
        }
        jobs_.push_back(w);
        const Away a = away_[uw][static_cast<size_t>(i)];
        const int32_t held_to = std::min<int32_t>(a.until, static_cast<int32_t>(n_));
        const int64_t kept = overflow_added(t, held_to, p_.size[uw]);
        // Rerun now: an extra rerun, unless it was due back anyway and stays.
        if (a.tail || kept > 0) total += s_.op_cost[static_cast<size_t>(p)];
        const int32_t to = kept == 0 ? held_to : t + 1;  // else there for the rerun only
        if (extra_overflow && kept > 0) *extra_overflow += overflow_added(t, t + 1, p_.size[uw]);
        if (!commit) continue;
        away_[uw][static_cast<size_t>(i)] = {a.after, t, false};
        add_live(t, to, p_.size[uw]);
        insert_need(w, t);
        if (kept > 0)
          away_[uw].push_back({t, a.until, a.tail});
        else if (a.until - t >= 2)
          cands_.push_back({w, t, a.until});  // it may still go after t, back for when it was due
        cut_.emplace_back(t, to);
      }
    }
    return total;
  }

  void insert_need(int32_t w, int32_t t) {
    auto& needs = needs_[static_cast<size_t>(w)];
    const auto it = std::lower_bound(needs.begin(), needs.end(), t);
    if (it == needs.end() || *it != t) needs.insert(it, t);
  }

  // A candidate is away one of two ways: until the first rerun in its gap that reads it (then it
  // stays), or across the whole gap, back for each such rerun and gone again right after it.
  struct Score {
    double ratio = 0;  // overflow covered per second of work, less the overflow its reruns bring back
    bool whole = false;
  };

  // The reruns in c's gap that read its value: [first, end) of its needs.
  std::pair<const int32_t*, const int32_t*> needs_in(const Candidate& c) const {
    const auto& needs = needs_[static_cast<size_t>(c.value)];
    const int32_t* first = std::upper_bound(needs.data(), needs.data() + needs.size(), c.after);
    const int32_t* end = std::lower_bound(first, needs.data() + needs.size(), c.until);
    return {first, end};
  }

  // v away after op `after` until op `until` (rerun there unless `tail`), and back for the reruns
  // [first, end) in between.
  double ratio_of(int32_t v, int32_t after, int32_t until, bool tail, const int32_t* first, const int32_t* end) {
    const auto uv = static_cast<size_t>(v);
    if (until - after < 2) return 0;
    double gain = 0;
    const int32_t* need = first;
    for (auto k = overs_.lower_bound(after + 1); k != overs_.end() && *k < until; ++k, ++work_) {
      while (need != end && *need < *k) ++need;
      if (need == end || *need != *k) gain += static_cast<double>(std::min(p_.size[uv], over_at(static_cast<size_t>(*k))));
    }
    if (gain <= 0) return 0;
    const double rerun = s_.op_cost[static_cast<size_t>(s_.value_producer[uv])];
    int64_t extra = 0;
    double cost = tail ? 0 : rerun + rerun_inputs(v, until, false, &extra);
    for (need = first; need != end && cost < kNever; ++need) cost += rerun + rerun_inputs(v, *need, false, &extra);
    gain -= static_cast<double>(extra);
    return cost >= kNever || gain <= 0 ? 0 : gain / std::max(cost, kMinCost);
  }

  Score score(const Candidate& c) {
    const auto [first, end] = needs_in(c);
    const bool tail = c.until > p_.last[static_cast<size_t>(c.value)];
    if (first == end) return {ratio_of(c.value, c.after, c.until, tail, end, end), false};
    const double until_first = ratio_of(c.value, c.after, *first, false, end, end);
    const double whole = ratio_of(c.value, c.after, c.until, tail, first, end);
    return whole > until_first ? Score{whole, true} : Score{until_first, false};
  }

  void offer(size_t i) {
    const double r = score(cands_[i]).ratio;
    if (r > 0)
      queue_.emplace(r, i);
    else
      idle_.push_back(i);
  }

  // The overflow grew over [from, to): idle candidates there may cover some now.
  void wake(int32_t from, int32_t to) {
    std::vector<size_t> idle;
    idle.swap(idle_);
    for (size_t i : idle) {
      const Candidate& c = cands_[i];
      if (c.after + 1 < to && from < c.until)
        offer(i);
      else
        idle_.push_back(i);
    }
  }

  void take(const Candidate c, bool whole) {  // a copy: the walks add candidates
    const auto v = static_cast<size_t>(c.value);
    const auto [first, end] = needs_in(c);
    std::vector<int32_t> reruns(first, end);
    const size_t known = cands_.size();
    int32_t until = c.until;
    if (!whole && !reruns.empty()) {  // away until the first
      until = reruns.front();
      reruns.clear();
      if (c.until - until >= 2) cands_.push_back({c.value, until, c.until});  // it may go again after it
    }
    const bool tail = until == c.until && c.until > p_.last[v];
    int32_t from = c.after;
    for (size_t i = 0; i <= reruns.size(); ++i) {
      const int32_t to = i < reruns.size() ? reruns[i] : until;
      away_[v].push_back({from, to, i == reruns.size() && tail});
      add_live(from + 1, std::min<int32_t>(to, static_cast<int32_t>(n_)), -p_.size[v]);
      from = to;
    }
    cut_.clear();
    for (int32_t t : reruns) rerun_inputs(c.value, t, true, nullptr);
    if (!tail) rerun_inputs(c.value, until, true, nullptr);
    // Scored after the walks: scoring walks too.
    for (size_t i = known; i < cands_.size(); ++i) offer(i);
    for (const auto& [lo, hi] : cut_) wake(lo, hi);
  }

  const StepArrays& s_;
  const Profile& p_;
  const size_t n_, m_;
  const int64_t budget_;
  std::vector<int64_t> live_;   // live bytes at each position, less what the picks keep away
  int64_t excess_;              // bytes over the budget, summed over positions
  std::set<int32_t> overs_;     // the positions over the budget
  std::vector<Candidate> cands_;
  std::priority_queue<std::pair<double, size_t>> queue_;  // (an upper bound of the ratio, candidate)
  std::vector<size_t> idle_;    // candidates that covered nothing when last scored
  std::vector<std::vector<Away>> away_;     // the picks, by value
  std::vector<std::vector<int32_t>> needs_;  // by value, ascending: ops whose reruns read it
  std::vector<uint32_t> seen_;  // rerun walks' marks
  uint32_t stamp_ = 0;
  std::vector<int32_t> jobs_;   // a rerun walk's reruns
  std::vector<std::pair<int32_t, int32_t>> cut_;  // where a pick's walk brought bytes back
  int64_t work_ = 0;            // positions and records visited
};

}  // namespace

std::vector<std::pair<int32_t, int32_t>> cover_releases(const StepArrays& s, int64_t budget) {
  if (s.op.empty() || budget <= 0) return {};
  const Profile p(s, budget);
  if (p.excess == 0) return {};
  // Greedy picks are myopic: which of two values it releases can turn on a near tie, and one rerun
  // more or less follows (the MILP's MLP at 0.6: a4 or a5). Covers of slightly less memory are
  // also covers of this budget; the cheapest of them by its own lineage prices is kept.
  std::vector<std::pair<int32_t, int32_t>> best;
  double best_cost = kNever;
  for (const double tighter : kCoverBudgets) {
    LineageCover cover(s, p, static_cast<int64_t>(static_cast<double>(budget) * tighter));
    auto due = cover.run();
    const double cost = cover.planned_cost();
    if (best.empty() || cost < best_cost) {
      best = std::move(due);
      best_cost = cost;
    }
    if (cover.work() > kMaxWork / 8) break;  // a long step: the search's time goes to one cover
  }
  return best;
}

std::vector<std::pair<int32_t, int32_t>> rebuild_releases(const StepArrays& s, int64_t budget) {
  if (s.op.empty() || budget <= 0) return {};
  const Profile p(s, budget);
  return RebuildCover(s, p, budget).run();
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
