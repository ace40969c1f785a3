// bench.cpp — see bench.h. Random choices are drawn before the clock starts.
#include "bench.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "arena.h"

namespace pymem {

namespace {

using Clock = std::chrono::steady_clock;

struct Plan {
  std::vector<size_t> sizes;  // sizes of the initial live blocks
  std::vector<uint32_t> slot; // per pair: which live block to replace
  std::vector<size_t> size;   // per pair: the new block's size
};

Plan make_plan(size_t live, size_t pairs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> logsize(std::log(512.0), std::log(256.0 * 1024));
  auto draw = [&] { return size_t(std::exp(logsize(rng))); };
  Plan p;
  for (size_t i = 0; i < live; ++i) p.sizes.push_back(draw());
  const size_t n = std::min<size_t>(pairs, 1 << 16);  // cycled: keeps the plan in cache
  std::uniform_int_distribution<uint32_t> pick(0, uint32_t(live - 1));
  for (size_t i = 0; i < n; ++i) {
    p.slot.push_back(pick(rng));
    p.size.push_back(draw());
  }
  return p;
}

template <class Alloc, class Free>
double run_pairs(const Plan& p, size_t pairs, Alloc alloc, Free release) {
  std::vector<uintptr_t> live;
  for (size_t s : p.sizes) live.push_back(alloc(s));
  const size_t n = p.slot.size();
  const auto t0 = Clock::now();
  for (size_t i = 0; i < pairs; ++i) {
    const size_t k = i % n;
    release(live[p.slot[k]]);
    live[p.slot[k]] = alloc(p.size[k]);
  }
  const double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
  for (uintptr_t a : live) release(a);
  return ns / double(pairs);
}

}  // namespace

double bench_arena_pairs(size_t live_blocks, size_t pairs, uint64_t seed) {
  if (live_blocks == 0 || pairs == 0) throw InvalidArgument("live_blocks and pairs must be positive");
  Plan p = make_plan(live_blocks, pairs, seed);
  ArenaConfig c;
  c.budget = align_up(live_blocks * 256 * 1024 * 2 + (64u << 20));  // never under pressure
  Arena a(make_virtual_backing(c.budget), c);
  return run_pairs(p, pairs, [&](size_t s) { return a.allocate(s); }, [&](uintptr_t x) { a.free(x); });
}

double bench_malloc_pairs(size_t live_blocks, size_t pairs, uint64_t seed) {
  if (live_blocks == 0 || pairs == 0) throw InvalidArgument("live_blocks and pairs must be positive");
  Plan p = make_plan(live_blocks, pairs, seed);
  return run_pairs(p, pairs, [](size_t s) { return reinterpret_cast<uintptr_t>(std::malloc(s)); },
                   [](uintptr_t x) { std::free(reinterpret_cast<void*>(x)); });
}

double bench_window_search(size_t blocks, size_t searches, uint64_t seed) {
  if (blocks < 8 || searches == 0) throw InvalidArgument("need at least 8 blocks and 1 search");
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> units(1, 128);  // 512 B .. 64 KiB
  std::uniform_real_distribution<double> cost(0.0, 1.0);
  std::vector<size_t> sizes;
  size_t total = 0;
  for (size_t i = 0; i < blocks; ++i) {
    sizes.push_back(units(rng) * kAlignment);
    total += sizes.back();
  }
  ArenaConfig c;
  c.budget = total;
  c.small_threshold = 0;
  Arena a(make_virtual_backing(total), c);
  std::vector<uintptr_t> addrs;
  for (size_t i = 0; i < blocks; ++i)
    addrs.push_back(a.allocate(sizes[i], CostClass::Costly, i + 1, cost(rng), i % 97 == 0));
  for (size_t i = 0; i < blocks; i += 5) a.free(addrs[i]);  // free gaps
  const size_t need = 4 * 64 * kAlignment / 2;
  const auto t0 = Clock::now();
  size_t found = 0;
  for (size_t i = 0; i < searches; ++i) found += a.find_window(need).found;
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  if (found != searches) throw std::runtime_error("bench_window_search: a search found no window");
  return us / double(searches);
}

}  // namespace pymem
