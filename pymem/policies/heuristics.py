"""The heuristics (DTR paper, section 4; Capuchin; Coop). Lowest score is released first.

Each is its score as data (base.py): the sum of ``costs`` over the product of ``per``, with
c = compute_cost (the producer's cost), e* = evicted_neighbour_cost (the evicted neighbourhood a
future recompute would redo), a* = evicted_ancestor_cost, m = nbytes, s = staleness.
"""
from .base import Policy, register


@register
class DTR(Policy):
    """h_DTR = (c + e*) / (m * s), with the union-find (h_DTR^eq) estimate of e*."""

    name = "dtr"
    costs = ("compute_cost", "evicted_neighbour_cost")
    per = ("nbytes", "staleness")


@register
class DTRChain(Policy):
    """h = (c + e* + a*) / (m * s): h_DTR plus a* = the exact cost of the evicted ancestors that a
    recompute of this tensor would redo first. The union-find e* spreads one component's cost over
    parents and children alike; a* weighs the chain above a value once more, so a long evicted
    chain (a residual stream, a recurrence) keeps its resident end. With fixed estimated op costs
    it recomputed up to 30% less than ``dtr`` on the benchmark's CNN and transformer at 25-70% of
    their peaks (26% at the transformer's 30%), and at most 3% more anywhere."""

    name = "dtr-chain"
    costs = ("compute_cost", "evicted_neighbour_cost", "evicted_ancestor_cost")
    per = ("nbytes", "staleness")


@register
class DTRLocal(Policy):
    """h_local = c / (m * s): DTR without the neighbourhood term."""

    name = "dtr-local"
    costs = ("compute_cost",)
    per = ("nbytes", "staleness")


@register
class LRU(Policy):
    """Least recently used first."""

    name = "lru"
    costs = ("last_access",)
    block_cost_per_byte = False


@register
class Size(Policy):
    """Largest first: 1 / m."""

    name = "size"
    per = ("nbytes",)
    block_cost_per_byte = False


@register
class MSPS(Policy):
    """Capuchin's memory saving per second, inverted so the lowest goes first:
    (c + cost of evicted ancestors) / m."""

    name = "msps"
    costs = ("compute_cost", "evicted_ancestor_cost")
    per = ("nbytes",)


@register
class Coop(Policy):
    """Coop's h = c' / s with c' = c + e*; no size term: the arena's window search weighs bytes
    itself. Used as the arena block cost (`Arena.set_cost`)."""

    name = "coop"
    costs = ("compute_cost", "evicted_neighbour_cost")
    per = ("staleness",)
    block_cost_per_byte = False  # c'/s per block: the window search weighs bytes itself
