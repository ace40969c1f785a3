"""Op costs measured once, then fixed: decisions that repeat run to run, at this CPU's own costs.

``cost=CostModel(...)`` makes pymem's decisions repeat, but its FLOP and byte rates misprice some
ops on a CPU: dropout's ``bernoulli_`` draws each element from a generator (about 8 ns an element
here: 4.3 ms for a 2 MiB mask, more than the 8 MiB ``addmm`` beside it), which the rates price as a
2 MiB write. ``cost="measured"`` prices it right, but each decision then follows that op's timing
on that run, so two runs of one program release different values.

``measured_costs(step)`` times every op of a few unmanaged calls of ``step()`` (a dispatch mode
around each kernel) and keeps the median per op and input shapes: ``MeasuredCosts``, a
``CostModel`` that answers from that table, and from the fixed rates for an op it never saw (a
rerun's ``clone``, say; ``misses`` counts them). Within one process every run then makes the same
decisions at the CPU's relative costs.
"""
import collections
import json
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pymem.cost_model import CostModel


def op_key(func, args, kwargs):
    """(op, the shapes of its tensor arguments in order): one table entry."""
    flat, _ = tree_flatten((args, kwargs))
    return str(func), tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))


class _OpTimer(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seconds = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self.seconds[op_key(func, args, kwargs)].append(time.perf_counter() - t0)
        return out


class MeasuredCosts(CostModel):
    """A ``CostModel`` whose ``seconds`` is the measured median of that op on those shapes; an op
    the table lacks is priced at the rates of ``fallback``."""

    def __init__(self, table, fallback: CostModel):
        super().__init__(fallback.flop_rate, fallback.byte_rate, fallback.launch, fallback.device)
        self.table = dict(table)
        self.misses = collections.Counter()  # op name -> calls priced by the fallback rates

    def seconds(self, func, args, kwargs, ins, out) -> float:
        known = self.table.get(op_key(func, args, kwargs))
        if known is not None:
            return known
        self.misses[str(func)] += 1
        return super().seconds(func, args, kwargs, ins, out)

    def __repr__(self) -> str:
        return f"MeasuredCosts({len(self.table)} ops and shapes)"


def measured_costs(step, fallback: CostModel, steps: int = 6, warmup: int = 1) -> MeasuredCosts:
    """Times every op of ``steps`` calls of ``step()`` (after ``warmup`` untimed ones), unmanaged;
    ``fallback`` prices what they never ran."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps!r}")
    for _ in range(warmup):
        step()
    timer = _OpTimer()
    with timer:
        for _ in range(steps):
            step()
    return MeasuredCosts({k: statistics.median(v) for k, v in timer.seconds.items()}, fallback)


def save_costs(costs: MeasuredCosts, path: str) -> None:
    """Writes the table as JSON ([op, [shape, ...], seconds] per entry), to run again at exactly
    these costs on another day (``load_costs``)."""
    rows = [[op, [list(shape) for shape in shapes], seconds] for (op, shapes), seconds in sorted(costs.table.items())]
    with open(path, "w") as f:
        json.dump(rows, f)


def load_costs(path: str, fallback: CostModel) -> MeasuredCosts:
    """A table ``save_costs`` wrote; a file that is not one is a ValueError that says what is wrong."""
    with open(path) as f:
        rows = json.load(f)
    table = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and isinstance(row[1], list)
                and isinstance(row[2], (int, float)) and row[2] >= 0):
            raise ValueError(f"{path}: each entry must be [op name, [shape, ...], seconds >= 0], got {row!r}")
        table[(row[0], tuple(tuple(shape) for shape in row[1]))] = float(row[2])
    return MeasuredCosts(table, fallback)


def costs_for(step, fallback: CostModel, path=None) -> MeasuredCosts:
    """``measured_costs(step)``, or where ``path`` names a table already saved, that table; a table
    measured is saved there (when ``path`` is given) for the next run."""
    if path is not None and os.path.exists(path):
        return load_costs(path, fallback)
    costs = measured_costs(step, fallback)
    if path is not None:
        save_costs(costs, path)
    return costs
