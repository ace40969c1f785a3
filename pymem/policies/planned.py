"""Belady's rule weighted by cost, from the step plan (issue 13's guided release).

A training step repeats, so the step before the one running says when each value will be read next
(csrc/step_plan.h): ``TensorView.next_use``, planned seconds of work until then. The value to release
is the one whose return costs least per byte and per second it may stay away:

    h = (c + e* + a*) / (m * d)

c: the producer's cost, e*: its evicted neighbourhood's (DTR's e*: recomputes that would read it),
a*: its evicted ancestors' (a recompute redoes them first; Capuchin's MSPS with the lineage as it
stands after every earlier pick), m: bytes, d: seconds to the next use
(infinite where the step reads it no more: released first, at no cost). Where the plan cannot say
(the first step, a step that left its plan, a value made before the step), the fallback policy
scores the value as it would without a plan. The runtime's release scan (csrc/release_scan.h)
evaluates the same: this formula, the fallback's where next_use is None, 0 where it is infinite.
"""
from .base import Policy, TensorView, formula_score

_NEVER = float("inf")


class Planned(Policy):
    """Not registered: the runtime wraps its policy in it when planning (``plan="auto"``)."""

    name = "planned"
    costs = ("compute_cost", "evicted_neighbour_cost", "evicted_ancestor_cost")
    per = ("nbytes", "next_use")

    def __init__(self, fallback: Policy) -> None:
        self.fallback = fallback
        self.uses_neighbourhood = fallback.uses_neighbourhood  # e* reads 0 where none is kept
        self.name = fallback.name  # the policy the program chose, planned

    def evaluate(self, t: TensorView, now: float) -> float:
        d = t.next_use
        if d is None:
            return self.fallback.evaluate(t, now)
        return self._score(t, now, d)

    def block_cost(self, t: TensorView, now: float) -> float:
        d = t.next_use  # a walk of the lineage (Record.next_use): once per candidate
        if d is None:
            return self.fallback.block_cost(t, now)
        return max(self._score(t, now, d), 0.0) * max(t.nbytes, 1)

    def _score(self, t: TensorView, now: float, d: float) -> float:
        if d == _NEVER:  # read no more this step: 0 whatever it cost, so its costs are not walked
            return 0.0
        return formula_score(self.costs, self.per, t, now, d)

    def __repr__(self) -> str:
        return f"Planned({self.fallback!r})"
