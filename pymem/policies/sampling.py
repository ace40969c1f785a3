"""Candidate sampling (DTR prototype): score ~sqrt(N) random candidates instead of all N.

Off by default: sampling makes tight budgets fail at random (the DTR authors retried runs up to
25 times). Tensors under `min_fraction` of the average size are skipped, as the prototype does.
"""
import math
import random
from typing import List, Optional, Sequence, TypeVar

T = TypeVar("T")


def sample_candidates(candidates: Sequence[T], rng: random.Random, sizes: Optional[Sequence[int]] = None,
                      min_fraction: float = 0.01) -> List[T]:
    """At most ceil(sqrt(N)) of `candidates`, drawn without replacement; with `sizes`, those below
    `min_fraction` of the mean size are left out first (unless that leaves none)."""
    pool = list(candidates)
    if sizes is not None:
        if len(sizes) != len(pool):
            raise ValueError(f"sizes has {len(sizes)} entries for {len(pool)} candidates")
        if pool:
            floor = min_fraction * sum(sizes) / len(sizes)
            big = [c for c, s in zip(pool, sizes) if s >= floor]
            pool = big or pool
    k = math.ceil(math.sqrt(len(pool)))
    return rng.sample(pool, k) if k < len(pool) else pool
