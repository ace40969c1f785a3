"""The policies: scores order tensors as each published heuristic says, the registry, the
union-find neighbourhood, and candidate sampling."""
import random
from dataclasses import dataclass

import pytest

from pymem.policies import EvictedNeighbourhood, get_director, get_policy, policy_names, sample_candidates


@dataclass
class T:
    nbytes: int
    compute_cost: float
    last_access: float
    evicted_neighbour_cost: float = 0.0
    evicted_ancestor_cost: float = 0.0


def order(policy, tensors, now=100.0):
    p = get_policy(policy)
    return sorted(range(len(tensors)), key=lambda i: p.evaluate(tensors[i], now))


def test_registry():
    assert policy_names() == ["coop", "dtr", "dtr-chain", "dtr-local", "lru", "msps", "size"]
    with pytest.raises(ValueError, match=r"unknown policy 'dtr2'; accepted: coop, dtr, dtr-chain, dtr-local, lru, "
                                         r"msps, size"):
        get_policy("dtr2")
    assert get_policy("dtr").uses_neighbourhood and not get_policy("dtr-local").uses_neighbourhood


def test_dtr_prefers_big_stale_cheap_tensors():
    ts = [T(100, 1.0, 99.0),   # small, fresh
          T(1000, 1.0, 99.0),  # bigger: released before 0
          T(1000, 1.0, 50.0),  # bigger and staler: first
          T(1000, 100.0, 50.0)]  # same but costly to recompute
    assert order("dtr", ts) == [2, 1, 3, 0]  # scores 2e-5, 1e-3, 2e-3, 1e-2
    h = get_policy("dtr")
    assert h.evaluate(ts[2], 100.0) == pytest.approx(1.0 / (1000 * 50.0))
    assert h.evaluate(ts[2], 100.0) < h.evaluate(ts[1], 100.0) < h.evaluate(ts[0], 100.0)


def test_dtr_counts_the_evicted_neighbourhood_and_local_does_not():
    a, b = T(1000, 1.0, 50.0), T(1000, 1.0, 50.0, evicted_neighbour_cost=10.0)
    assert get_policy("dtr").evaluate(a, 100) < get_policy("dtr").evaluate(b, 100)
    assert get_policy("dtr-local").evaluate(a, 100) == get_policy("dtr-local").evaluate(b, 100)
    assert get_policy("dtr").evaluate(b, 100) == pytest.approx(11.0 / (1000 * 50.0))


def test_dtr_chain_adds_the_evicted_ancestors_to_dtr():
    a = T(1000, 1.0, 50.0, evicted_neighbour_cost=10.0)
    b = T(1000, 1.0, 50.0, evicted_neighbour_cost=10.0, evicted_ancestor_cost=30.0)
    chain, dtr = get_policy("dtr-chain"), get_policy("dtr")
    assert chain.evaluate(a, 100) == dtr.evaluate(a, 100)  # no evicted ancestors: h_DTR
    assert chain.evaluate(b, 100) == pytest.approx(41.0 / (1000 * 50.0))
    assert chain.evaluate(b, 100) > dtr.evaluate(b, 100)
    assert order("dtr-chain", [b, a]) == [1, 0]


def test_lru_size_msps_coop():
    ts = [T(100, 5.0, 10.0), T(5000, 1.0, 90.0, evicted_ancestor_cost=100.0), T(2000, 1.0, 40.0)]
    assert order("lru", ts) == [0, 2, 1]
    assert order("size", ts) == [1, 2, 0]
    # msps: (c + evicted ancestors) / m -> 0.05, 0.0202, 0.0005
    assert order("msps", ts) == [2, 1, 0]
    # coop: c' / s, no size term -> 5/90, 1/10, 1/60
    assert order("coop", ts) == [2, 0, 1]


def test_fresh_tensor_scores_stay_finite():
    t = T(1000, 1.0, 100.0)
    for name in policy_names():
        v = get_policy(name).evaluate(t, 100.0)
        assert v == v and abs(v) != float("inf")


def test_neighbourhood_union_find():
    a, b, c, d, x, y = range(6)
    n = EvictedNeighbourhood()
    # a -> b -> c -> d chain; evict b then c: one class {b, c}
    n.on_evict(b, 2.0, [a, c])
    n.on_evict(c, 3.0, [b, d])
    assert n.neighbour_cost([b]) == 5.0            # e*(a): the whole class
    assert n.neighbour_cost([b, c]) == 5.0         # one class counted once
    n.on_evict(x, 7.0, [y])                         # unrelated class
    assert n.neighbour_cost([c, x]) == 12.0
    n.on_rematerialize(b)                           # class not split; b's cost leaves it
    assert not n.is_evicted(b) and n.is_evicted(c)
    assert n.neighbour_cost([c]) == 3.0
    assert n.neighbour_cost([b]) == 0.0             # resident neighbours cost nothing
    n.on_evict(b, 2.0, [c])                         # evicted again: a fresh node, same class
    assert n.neighbour_cost([b]) == 5.0
    assert len(n) == 4                              # b's first node stays, stale
    with pytest.raises(ValueError, match="1 is already evicted"):
        n.on_evict(b, 1.0, [])
    with pytest.raises(ValueError, match="compute cost must be >= 0"):
        n.on_evict(y, -1.0, [])
    with pytest.raises(KeyError, match="5 is not evicted"):
        n.on_rematerialize(y)
    with pytest.raises(TypeError):
        n.on_evict("z", 1.0, [])


def test_sampling_is_optional_and_bounded():
    rng = random.Random(0)
    cands = list(range(100))
    got = sample_candidates(cands, rng)
    assert len(got) == 10 and len(set(got)) == 10 and set(got) <= set(cands)
    sizes = [1] * 50 + [1000] * 50  # the tiny half is below 1% of the mean size
    got = sample_candidates(cands, rng, sizes)
    assert all(c >= 50 for c in got) and len(got) == 8
    assert sample_candidates([3], rng) == [3]
    with pytest.raises(ValueError, match="sizes has 2 entries for 3 candidates"):
        sample_candidates([1, 2, 3], rng, [1, 2])


@dataclass
class V:
    """What a director reads."""
    compute_cost: float
    swap_cost: float
    next_use: object = None
    has_host_copy: bool = False
    evicted_ancestor_cost: float = 0.0


def test_capuchin_swaps_what_hides_behind_compute_and_recomputes_the_rest():
    cap, delta = get_director("capuchin"), get_director("delta")
    # No plan: DELTA's rule (2 c_s < c + a*).
    for v in (V(3.0, 1.0), V(1.5, 1.0), V(0.5, 1.0, evicted_ancestor_cost=2.0)):
        assert cap.evaluate(v, 0.0) == delta.evaluate(v, 0.0)
    assert not cap.evaluate(V(100.0, 1.0, next_use=float("inf")), 0.0)  # never read again: evict, free
    # The copy back hides behind 5 s of compute; the copy out (1 s) stays exposed.
    assert cap.evaluate(V(1.5, 1.0, next_use=5.0), 0.0)        # 1 < 1.5
    assert not cap.evaluate(V(0.5, 1.0, next_use=5.0), 0.0)    # 1 > 0.5: recompute
    assert cap.evaluate(V(0.5, 1.0, next_use=5.0, has_host_copy=True), 0.0)  # nothing exposed
    # Read soon: 0.8 s of the copy back is exposed too.
    assert not cap.evaluate(V(1.5, 1.0, next_use=0.2), 0.0)    # 1.8 > 1.5
    assert cap.evaluate(V(1.5, 1.0, next_use=0.2, evicted_ancestor_cost=1.0), 0.0)  # 1.8 < 2.5 (lineage)


def test_policies_import_no_torch():
    """A program may import pymem.policies (to register a policy) before torch, with PYMEM_BUDGET set:
    the policies import nothing that imports torch (the union-find is read lazily from pymem._C)."""
    import subprocess
    import sys
    code = ("import sys, pymem.policies as p; assert 'torch' not in sys.modules, 'torch imported'; "
            "n = p.EvictedNeighbourhood(); n.on_evict(1, 2.0, [3]); assert n.neighbour_cost([1]) == 2.0; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    env = dict(__import__("os").environ, PYMEM_BUDGET="1GB", PYMEM_DEVICE="cpu")
    code = "import pymem._startup as s; s.activate(); import pymem.policies; import torch; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_policy_with_its_own_evaluate_keeps_its_neighbourhood():
    from pymem.policies import Policy

    class ReadsEStar(Policy):
        name = "reads-e-star-test"
        uses_neighbourhood = True

        def evaluate(self, t, now):
            return t.evicted_neighbour_cost

    class Plain(Policy):
        name = "plain-test"

        def evaluate(self, t, now):
            return 0.0

    assert ReadsEStar.uses_neighbourhood and not Plain.uses_neighbourhood
    assert get_policy("dtr").uses_neighbourhood and not get_policy("msps").uses_neighbourhood
