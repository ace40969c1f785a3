"""A lower bound on any replay's overhead: what no policy of pymem's kind can beat on a trace, a
budget and a device (issue 16: when a target is out of reach, this says by how much, measured).

pymem keeps the program's op order and op times; it may release a recomputable value (it is
recomputed at least once before its next read, at no less than its producer's seconds) or copy any
value to the host (one link per direction, ``link_bytes_per_s``). Look at one op k:

- its inputs and fresh outputs are resident while it runs: ``working`` bytes;
- every other live value is resident, or on the host, or (recomputable) released. A recomputable
  value that nothing reads after k goes for free. A leaf can only go to the host.
- bytes reach the host no faster than the link carries them: in the ``seconds`` before op k since
  the earliest moment any of these values existed (the previous step's optimizer writes the values
  made before the step), plus any time the step stands still waiting for the link (``stall``);
- so ``excess = live + working - budget`` bytes are away at op k: ``link`` of them copied, the
  rest released, the cheapest per byte first (fractional: a relaxation, so a bound):

      bound(k) = min over stall >= 0 of  stall + recompute(excess - link_rate * (seconds + stall))

  and a release costs no less than its producer's seconds (ancestors, copies back and placement
  only add). The bound is the largest over the ops; infinite where an op's working set alone
  exceeds the budget. It ignores the copies back and every cost of order, so real replays sit
  above it: a gap is what a better policy could still win, no more.
"""
from typing import Dict, Optional

import numpy as np

from ..gpus import gpu_spec
from .trace import Trace

_ALIGN = 512


def _op_times(trace: Trace, device: Optional[str]) -> np.ndarray:
    from .replay import _op_seconds
    return _op_seconds(trace, device)


def lower_bound(trace: Trace, budget: int, device: Optional[str] = "h100",
                link_bytes_per_s: Optional[float] = None, candidates: int = 256) -> Dict:
    """{"overhead": the bound (inf: an op alone exceeds the budget), "at_op": the op that gives it,
    "excess_bytes", "link_bytes", "recompute_seconds", "stall_seconds", "step_seconds"} for replays
    of ``trace`` under ``budget`` bytes. ``candidates``: how many ops (those with the most bytes
    that the link cannot take) get the exact evaluation."""
    if not isinstance(budget, (int, np.integer)) or budget <= 0:
        raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
    seconds = _op_times(trace, device)
    if link_bytes_per_s is None:
        link_bytes_per_s = gpu_spec(device).host_bytes_per_s if device else 32e9
    link = float(link_bytes_per_s)
    n, m = trace.num_ops, trace.num_values
    step = float(seconds.sum())
    size = (-(-trace.value_bytes // _ALIGN) * _ALIGN).astype(np.float64)
    start = trace.value_producer.astype(np.int64)  # -1: made before the step
    end = np.where(trace.value_free_at < 0, n, trace.value_free_at).astype(np.int64)
    # An in-place op hands the storage on: the value it rewrote is gone from that op on.
    over = np.flatnonzero(trace.value_overwrites >= 0)
    end[trace.value_overwrites[over]] = np.minimum(end[trace.value_overwrites[over]], start[over] - 1)
    last_read = np.full(m, -1, np.int64)
    for k in range(n):
        last_read[trace.op_inputs(k)] = k
    recomputable = trace.value_recomputable.astype(bool)
    # A release costs its share (by bytes) of its producer's seconds: an op that made several values
    # makes them all again at once, in the best case.
    made_bytes = np.zeros(n)
    np.add.at(made_bytes, start[start >= 0], size[start >= 0])
    cost = np.where(start >= 0, seconds[np.clip(start, 0, None)] * size / np.maximum(made_bytes[np.clip(start, 0, None)], 1.0), 0.0)
    # A value made before the step that the step never rewrites may have a host copy from long ago:
    # it goes for free, like a recomputable value.
    rewritten = np.zeros(m, bool)
    rewritten[trace.value_overwrites[over]] = True
    recomputable |= (start < 0) & ~rewritten

    # Live bytes per op by category, from interval sums (a difference array over the ops).
    def interval_sum(mask: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        d = np.zeros(n + 2)
        lo_c, hi_c = np.clip(lo[mask] + 1, 0, n + 1), np.clip(hi[mask] + 2, 0, n + 1)
        ok = hi_c > lo_c
        np.add.at(d, lo_c[ok], size[mask][ok])
        np.add.at(d, hi_c[ok], -size[mask][ok])
        return np.cumsum(d)[1:n + 1]

    # live at op k: start <= k <= end; shifted by one so that -1 (before the step) is index 0.
    leaf_live = interval_sum(~recomputable, start, end)
    # Recomputable and read after k: live from start to min(end, last_read - 1).
    needed_hi = np.minimum(end, last_read - 1)
    act_live = interval_sum(recomputable, start, needed_hi)
    working = np.zeros(n)
    in_ws_leaf = np.zeros(n)
    in_ws_act = np.zeros(n)
    for k in range(n):
        vs = np.unique(np.concatenate([trace.op_inputs(k), trace.op_outputs(k)]))
        vs = vs[(trace.value_overwrites[vs] < 0) | np.isin(vs, trace.op_inputs(k))]
        working[k] = size[vs].sum()
        live = (start[vs] <= k) & (k <= end[vs])
        in_ws_leaf[k] = size[vs][live & ~recomputable[vs]].sum()
        in_ws_act[k] = size[vs][live & recomputable[vs] & (k <= needed_hi[vs])].sum()
    leaves = leaf_live - in_ws_leaf
    acts = act_live - in_ws_act
    room = budget - working
    if (room < 0).any():
        k = int(np.argmax(room < 0))
        return {"overhead": float("inf"), "at_op": k, "excess_bytes": int(-room[k]), "link_bytes": 0,
                "recompute_seconds": 0.0, "stall_seconds": 0.0, "step_seconds": step}
    # The earliest a value live now could start its copy out: the values made before the step were
    # written by the previous step's optimizer (from the first op that overwrites one of them).
    pre = np.flatnonzero(start < 0)
    writes = [int(start[v]) for v in over if trace.value_overwrites[v] in set(pre.tolist())]
    tail = float(seconds[min(writes):].sum()) if writes else 0.0
    before = np.concatenate([[0.0], np.cumsum(seconds)])[:n] + tail
    excess = leaves + acts - room
    order = np.argsort(-(excess - link * before))[:max(1, candidates)]
    best = {"overhead": 1.0, "at_op": -1, "excess_bytes": 0, "link_bytes": 0, "recompute_seconds": 0.0,
            "stall_seconds": 0.0, "step_seconds": step}
    worst = 0.0
    for k in order:
        k = int(k)
        x = excess[k]
        if x <= 0:
            continue
        live = (start <= k) & (k <= needed_hi) & recomputable
        ws = np.concatenate([trace.op_inputs(k), trace.op_outputs(k)])
        live[ws] = False
        per_byte = cost[live] / size[live]
        sizes = size[live][np.argsort(per_byte)]
        per_byte = np.sort(per_byte)
        # Copy what the link carries in time; the leaves that do not fit must go that way too.
        leaf_out = max(0.0, leaves[k] - room[k])
        stall = max(0.0, leaf_out / link - before[k])
        rest = x - link * (before[k] + stall)  # bytes to release, or to copy while standing still
        recompute = 0.0
        for b, c in zip(sizes, per_byte):
            if rest <= 0 or c >= 1.0 / link:  # from here on, standing still for the link is cheaper
                break
            take = min(b, rest)
            recompute += take * c
            rest -= take
        stall += max(0.0, rest) / link
        spent = stall + recompute
        if spent > worst:
            worst = spent
            best = {"overhead": (step + spent) / step, "at_op": k, "excess_bytes": int(x),
                    "link_bytes": int(min(x, link * (before[k] + stall))), "recompute_seconds": float(recompute),
                    "stall_seconds": float(stall), "step_seconds": step}
    return best
