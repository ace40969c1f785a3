"""The simulator's trace: one training step as arrays, saved as one ``.npz`` file.

It extends the runtime's step trace (csrc/step_trace.h: ops in order, their input values and fresh
output values, each value's bytes, producer and recipe) with what a replay at another scale needs:

  ops (n):     op_names[op[k]]  the op's name ("aten.mm.default")
               op_flops[k]      FLOPs by torch's counter (0 where it has no formula)
               op_bytes[k]      bytes its tensors span, inputs plus outputs (the memory traffic)
               op_fp32[k]       1: computes in fp32 (no tensor cores); 0: bf16/fp16 or no floats
               op_kernel[k]     0: launches no kernel (a view, a metadata op): costs nothing
               op_cost[k]       seconds as recorded (the runtime's measured or estimated cost);
                                NaN where the trace was captured without running anything
               inputs_start[k] .. inputs_start[k+1]    indices into `inputs`: the values it reads
               outputs_start[k] .. outputs_start[k+1]  indices into `outputs`: the values it makes
  values (m):  value_bytes[v], value_producer[v] (-1: made before the step: resident at its start),
               value_recomputable[v] (0: a leaf: only offloading can release it),
               value_free_at[v]   the op after which its storage dies (-1: alive at the step's end)
               value_overwrites[v]  the value whose storage an in-place op rewrote to make v
                                  (-1: a fresh storage): v takes over its bytes, nothing is allocated
               value_blank_rerun[v]  1: that op wrote over all of it without reading it (fill_,
                                  bernoulli_, copy_ over a whole storage), so a rerun of it starts
                                  from a blank buffer and reads not that value (csrc/step_trace.h);
                                  optional in a file (absent: all 0)
  backward_at  the first op of the backward pass (-1: none)
  meta         a JSON string: where the trace came from (model, batch, dtype, source)

A view is no value: it reads its storage's. Values are numbered in the order they appear. The
``.npz`` holds exactly these names; ``Trace.load`` checks that every array is present and consistent.
"""
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

_OP_ARRAYS = {"op": np.int32, "op_flops": np.int64, "op_bytes": np.int64, "op_fp32": np.uint8,
              "op_kernel": np.uint8, "op_cost": np.float64}
_VALUE_ARRAYS = {"value_bytes": np.int64, "value_producer": np.int32, "value_recomputable": np.uint8,
                 "value_free_at": np.int32, "value_overwrites": np.int32}
_EDGE_ARRAYS = {"inputs_start": np.int64, "inputs": np.int32, "outputs_start": np.int64, "outputs": np.int32}


class TraceError(ValueError):
    """A trace file that is not one, or whose arrays disagree."""


@dataclass
class Trace:
    op_names: List[str]
    op: np.ndarray
    op_flops: np.ndarray
    op_bytes: np.ndarray
    op_fp32: np.ndarray
    op_kernel: np.ndarray
    op_cost: np.ndarray
    inputs_start: np.ndarray
    inputs: np.ndarray
    outputs_start: np.ndarray
    outputs: np.ndarray
    value_bytes: np.ndarray
    value_producer: np.ndarray
    value_recomputable: np.ndarray
    value_free_at: np.ndarray
    value_overwrites: np.ndarray
    backward_at: int = -1
    meta: Dict = field(default_factory=dict)
    value_blank_rerun: Optional[np.ndarray] = None  # None: every rerun reads what its op overwrote

    def __post_init__(self) -> None:
        if self.value_blank_rerun is None:
            self.value_blank_rerun = np.zeros(len(self.value_bytes), np.uint8)

    @property
    def num_ops(self) -> int:
        return len(self.op)

    @property
    def num_values(self) -> int:
        return len(self.value_bytes)

    def op_inputs(self, k: int) -> np.ndarray:
        return self.inputs[self.inputs_start[k]:self.inputs_start[k + 1]]

    def op_outputs(self, k: int) -> np.ndarray:
        return self.outputs[self.outputs_start[k]:self.outputs_start[k + 1]]

    def op_name(self, k: int) -> str:
        return self.op_names[self.op[k]]

    def save(self, path: str) -> None:
        arrays = {name: getattr(self, name) for name in (*_OP_ARRAYS, *_VALUE_ARRAYS, *_EDGE_ARRAYS)}
        np.savez_compressed(path, op_names=np.array(self.op_names, dtype=str), backward_at=np.int64(self.backward_at),
                            meta=np.array(json.dumps(self.meta)),
                            value_blank_rerun=np.asarray(self.value_blank_rerun, np.uint8), **arrays)

    @classmethod
    def load(cls, path: str) -> "Trace":
        try:
            with np.load(path, allow_pickle=False) as f:
                data = {k: f[k] for k in f.files}
        except (OSError, ValueError) as e:
            raise TraceError(f"{path}: not a pymem trace (.npz): {e}") from None
        wanted = ("op_names", "backward_at", "meta", *_OP_ARRAYS, *_VALUE_ARRAYS, *_EDGE_ARRAYS)
        missing = [k for k in wanted if k not in data]
        if missing:
            raise TraceError(f"{path}: not a pymem trace: missing {', '.join(missing)}")
        t = cls(op_names=[str(s) for s in data["op_names"]], backward_at=int(data["backward_at"]),
                meta=json.loads(str(data["meta"])),
                value_blank_rerun=data["value_blank_rerun"].astype(np.uint8) if "value_blank_rerun" in data else None,
                **{k: data[k].astype(d, copy=False) for k, d in {**_OP_ARRAYS, **_VALUE_ARRAYS, **_EDGE_ARRAYS}.items()})
        t.check(path)
        return t

    def check(self, where: str = "trace") -> None:
        """Raise TraceError unless the arrays describe one step consistently."""
        n, m = self.num_ops, self.num_values
        for name in _OP_ARRAYS:
            if len(getattr(self, name)) != n:
                raise TraceError(f"{where}: {name} has {len(getattr(self, name))} entries for {n} ops")
        for name in _VALUE_ARRAYS:
            if len(getattr(self, name)) != m:
                raise TraceError(f"{where}: {name} has {len(getattr(self, name))} entries for {m} values")
        blank = self.value_blank_rerun
        if len(blank) != m:
            raise TraceError(f"{where}: value_blank_rerun has {len(blank)} entries for {m} values")
        if np.any(blank > 1) or np.any((blank == 1) & (self.value_overwrites < 0)):
            raise TraceError(f"{where}: value_blank_rerun must be 0 or 1, and 1 only where value_overwrites names "
                             "the value overwritten")
        for starts, items in (("inputs_start", "inputs"), ("outputs_start", "outputs")):
            s, x = getattr(self, starts), getattr(self, items)
            if len(s) != n + 1 or s[0] != 0 or s[-1] != len(x) or np.any(np.diff(s) < 0):
                raise TraceError(f"{where}: {starts} does not index {items} for {n} ops")
            if len(x) and (x.min() < 0 or x.max() >= m):
                raise TraceError(f"{where}: {items} names a value outside 0..{m - 1}")
        if n and (self.op.min() < 0 or self.op.max() >= len(self.op_names)):
            raise TraceError(f"{where}: op codes outside the {len(self.op_names)} op names")
        p = self.value_producer
        if m and (p.min() < -1 or p.max() >= n):
            raise TraceError(f"{where}: value_producer outside -1..{n - 1}")
        if np.any(self.value_bytes < 0):
            raise TraceError(f"{where}: negative value_bytes")
        made = np.full(m, -1, dtype=np.int64)
        for k in range(n):
            made[self.op_outputs(k)] = k
        if np.any(made[p >= 0] != p[p >= 0]):
            raise TraceError(f"{where}: a value's producer does not list it among its outputs")
        if not -1 <= self.backward_at < max(n, 1):
            raise TraceError(f"{where}: backward_at {self.backward_at} outside -1..{n - 1}")

    def peak_bytes(self, align: int = 512) -> int:
        """Bytes live at the step's peak with nothing released (the unmanaged peak, blocks rounded
        up to ``align`` as the arena rounds them)."""
        size = -(-self.value_bytes // align) * align
        live = int(size[self.value_producer < 0].sum())
        peak = live
        ends: Dict[int, int] = {}
        for v, k in enumerate(self.value_free_at):
            if k >= 0:
                ends[int(k)] = ends.get(int(k), 0) + int(size[v])
        for k in range(self.num_ops):
            for v in self.op_outputs(k):
                if self.value_overwrites[v] < 0:
                    live += int(size[v])
            peak = max(peak, live)
            live -= ends.get(k, 0)
        return peak


def from_step_arrays(step: Dict[str, np.ndarray], op_name, meta: Optional[Dict] = None) -> Trace:
    """A Trace of the runtime's last step (``Runtime.trace.last_step()``): costs as the runtime
    booked them, no FLOPs or bytes (replay it with the recorded costs). Deaths and in-place writes
    as the runtime observed them where it did (a step that followed its plan whole); else a value
    the step made dies after its last read (or its producer), a leaf lives on."""
    op = np.asarray(step["op"], dtype=np.int64)
    codes = sorted(set(op.tolist()))
    index = {c: i for i, c in enumerate(codes)}
    n, m = len(op), len(step["value_bytes"])
    inputs_start, inputs = np.asarray(step["inputs_start"]), np.asarray(step["inputs"])
    producer = np.asarray(step["value_producer"], dtype=np.int32)
    # A value made before the step has no producer here to replay: a leaf of this step.
    recomputable = np.where(producer >= 0, np.asarray(step["value_recomputable"]), 0).astype(np.uint8)
    last = producer.astype(np.int64).copy()
    for k in range(n):
        for v in inputs[inputs_start[k]:inputs_start[k + 1]]:
            last[v] = k
    observed = "value_free_at" in step and "value_overwrites" in step
    if observed:
        free_at = np.where(producer >= 0, np.asarray(step["value_free_at"]), -1).astype(np.int32)
        overwrites = np.asarray(step["value_overwrites"], dtype=np.int32)
        blank = np.asarray(step["value_blank_rerun"], np.uint8) if "value_blank_rerun" in step else None
    else:
        blank = None
        free_at = np.where((producer >= 0) & (recomputable == 1), last, -1).astype(np.int32)
        overwrites = np.full(m, -1, np.int32)
    t = Trace(op_names=[op_name(c) for c in codes], op=np.array([index[c] for c in op.tolist()], dtype=np.int32),
              op_flops=np.zeros(n, np.int64), op_bytes=np.zeros(n, np.int64), op_fp32=np.ones(n, np.uint8),
              op_kernel=np.ones(n, np.uint8), op_cost=np.asarray(step["op_cost"], dtype=np.float64),
              inputs_start=np.asarray(inputs_start, np.int64), inputs=np.asarray(inputs, np.int32),
              outputs_start=np.asarray(step["outputs_start"], np.int64), outputs=np.asarray(step["outputs"], np.int32),
              value_bytes=np.asarray(step["value_bytes"], np.int64), value_producer=producer,
              value_recomputable=recomputable, value_free_at=free_at, value_overwrites=overwrites,
              value_blank_rerun=blank, meta=dict(meta or {}, source="runtime", deaths="observed" if observed else "last read"))
    t.check("runtime step")
    return t
