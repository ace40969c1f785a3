"""Read the DTR prototype's simulator logs (uwsampl/dtr-prototype, simrd) into a Trace.

A log is JSON lines, each with an ``INSTRUCTION``:

  CONSTANT {NAME}              a tensor that exists before the step (a parameter, the batch); the
                               next line is its MEMORY
  MEMORY {NAME, MEMORY}        bytes of the tensor just named
  CALL {RESULT, NAME, ARGS, TIME}  an op: result names, op name, argument names, its time; each
                               result is followed by its MEMORY and its ALIAS line
  ALIAS {NAME, ALIAS}          -1: the result is a fresh storage; i >= 0: a view of argument i
  MUTATE {NAME, ARGS, MUTATE, TIME}  an in-place op: it rewrites the arguments at the MUTATE
                               indices, which get new values (the old ones lose a reference)
  COPY {DST, SRC}              DST names SRC's tensor too (one more reference)
  COPY_FROM {DST, SRC}         DST now names SRC's tensor (its old tensor loses a reference)
  RELEASE {NAME}               the name's reference is dropped; a storage with none left is freed
  ANNOTATE {ANNOTATION}        START: the step begins (lines before it are skipped when present);
                               BACKWARD: the backward pass begins

simrd's own semantics are kept: an in-place op makes a new value in fresh memory (simrd copies it),
constants are never released (leaves), and what is still referenced at the end stays alive.
``TIME`` carries no unit in the logs: it is read as ``time_unit`` seconds (default 1e-6, i.e.
microseconds); overheads are ratios and do not depend on it, copy costs against a GPU's host
link do.
"""
import json
from typing import Dict, Iterable, List

import numpy as np

from .trace import Trace, TraceError

_KNOWN = {"CONSTANT", "MEMORY", "CALL", "ALIAS", "MUTATE", "COPY", "COPY_FROM", "RELEASE", "ANNOTATE"}


class _Reader:
    def __init__(self, time_unit: float) -> None:
        self.time_unit = time_unit
        self.names: Dict[str, int] = {}      # op name -> code
        self.op: List[int] = []
        self.cost: List[float] = []
        self.ins: List[List[int]] = []
        self.outs: List[List[int]] = []
        self.value_bytes: List[int] = []
        self.producer: List[int] = []
        self.recipe: List[bool] = []
        self.refs: List[int] = []             # references to each value (names and views)
        self.free_at: List[int] = []
        self.bound: Dict[str, int] = {}       # tensor name -> the value it reads
        self.backward_at = -1

    def value(self, nbytes: int, producer: int, recipe: bool) -> int:
        self.value_bytes.append(nbytes)
        self.producer.append(producer)
        self.recipe.append(recipe)
        self.refs.append(0)
        self.free_at.append(-1)
        return len(self.value_bytes) - 1

    def bind(self, name: str, v: int, line: int) -> None:
        if name in self.bound:
            raise TraceError(f"simrd log line {line}: {name!r} is defined twice")
        self.bound[name] = v
        self.refs[v] += 1

    def unref(self, v: int) -> None:
        self.refs[v] -= 1
        if self.refs[v] == 0:
            self.free_at[v] = max(len(self.op) - 1, 0)

    def lookup(self, name: str, line: int) -> int:
        v = self.bound.get(name)
        if v is None:
            raise TraceError(f"simrd log line {line}: {name!r} is used before it is defined")
        return v

    def op_code(self, name: str) -> int:
        return self.names.setdefault(name, len(self.names))


def _records(lines: Iterable[str]) -> List[tuple]:
    out = []
    for i, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            j = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"simrd log line {i}: not JSON ({e.msg})") from None
        instr = j.get("INSTRUCTION") if isinstance(j, dict) else None
        if instr not in _KNOWN:
            raise TraceError(f"simrd log line {i}: unknown INSTRUCTION {instr!r}; accepted: {', '.join(sorted(_KNOWN))}")
        out.append((i, instr, j))
    if any(instr == "ANNOTATE" and j.get("ANNOTATION") == "START" for _, instr, j in out):
        while not (out[0][1] == "ANNOTATE" and out[0][2].get("ANNOTATION") == "START"):
            out.pop(0)
        out.pop(0)
    return out


def _field(j: dict, key: str, line: int):
    if key not in j:
        raise TraceError(f"simrd log line {line}: {j['INSTRUCTION']} without {key}")
    return j[key]


def read_simrd(lines: Iterable[str], time_unit: float = 1e-6) -> Trace:
    """A Trace of a simrd log (its lines)."""
    r = _Reader(time_unit)
    recs = _records(lines)
    i = 0

    def expect(instr: str, name: str) -> dict:
        nonlocal i
        if i >= len(recs) or recs[i][1] != instr or recs[i][2].get("NAME") != name:
            got = recs[i][1] if i < len(recs) else "the end of the log"
            raise TraceError(f"simrd log line {recs[i - 1][0]}: expected {instr} of {name!r}, found {got}")
        i += 1
        return recs[i - 1][2]

    while i < len(recs):
        line, instr, j = recs[i]
        i += 1
        if instr == "CONSTANT":
            name = _field(j, "NAME", line)
            m = expect("MEMORY", name)
            r.bind(name, r.value(int(m["MEMORY"]), -1, False), line)
        elif instr == "CALL" or instr == "MUTATE":
            k = len(r.op)
            ins = []
            args = [str(a) for a in _field(j, "ARGS", line)]
            for a in args:
                v = r.lookup(a, line)
                if v not in ins:
                    ins.append(v)
            outs, olds = [], []
            if instr == "CALL":
                for name in _field(j, "RESULT", line):
                    m = expect("MEMORY", name)
                    alias = int(expect("ALIAS", name)["ALIAS"])
                    if alias == -1:
                        v = r.value(int(m["MEMORY"]), k, True)
                        outs.append(v)
                    elif 0 <= alias < len(args):
                        v = r.lookup(args[alias], line)  # a view reads its base's value
                    else:
                        raise TraceError(f"simrd log line {line}: ALIAS {alias} of {name!r} names no argument")
                    r.bind(name, v, line)
            else:
                for idx in _field(j, "MUTATE", line):
                    if not 0 <= int(idx) < len(args):
                        raise TraceError(f"simrd log line {line}: MUTATE index {idx} names no argument")
                    name = args[int(idx)]
                    old = r.bound.pop(name)
                    olds.append(old)
                    v = r.value(r.value_bytes[old], k, r.recipe[old])
                    outs.append(v)
                    r.bind(name, v, line)
            r.op.append(r.op_code(str(_field(j, "NAME", line))))
            r.cost.append(float(_field(j, "TIME", line)) * time_unit)
            r.ins.append(ins)
            r.outs.append(outs)
            for old in olds:  # the rewritten arguments' old values lose their names after the op
                r.unref(old)
            if r.backward_at < 0 and "backward" in str(j["NAME"]):  # as simrd marks it
                r.backward_at = k
        elif instr == "MEMORY" or instr == "ALIAS":
            raise TraceError(f"simrd log line {line}: {instr} of {j.get('NAME')!r} follows no CONSTANT or CALL")
        elif instr == "COPY":
            dst, src = str(_field(j, "DST", line)), str(_field(j, "SRC", line))
            r.bind(dst, r.lookup(src, line), line)
        elif instr == "COPY_FROM":
            dst, src = str(_field(j, "DST", line)), str(_field(j, "SRC", line))
            old = r.lookup(dst, line)
            new = r.lookup(src, line)
            del r.bound[dst]
            r.bind(dst, new, line)
            r.unref(old)
        elif instr == "RELEASE":
            name = str(_field(j, "NAME", line))
            v = r.bound.pop(name, None)
            if v is not None:  # simrd ignores releases of undefined names too
                r.unref(v)
        elif instr == "ANNOTATE":
            if j.get("ANNOTATION") == "BACKWARD" and r.backward_at < 0:
                r.backward_at = len(r.op)
    return _trace(r)


def _trace(r: _Reader) -> Trace:
    n, m = len(r.op), len(r.value_bytes)
    free_at = np.array(r.free_at, dtype=np.int32)
    alive = np.array(r.refs) > 0 if m else np.zeros(0, dtype=bool)
    free_at[alive] = -1
    starts = lambda xs: np.concatenate([[0], np.cumsum([len(x) for x in xs])]).astype(np.int64)  # noqa: E731
    t = Trace(op_names=list(r.names), op=np.array(r.op, np.int32), op_flops=np.zeros(n, np.int64),
              op_bytes=np.zeros(n, np.int64), op_fp32=np.zeros(n, np.uint8), op_kernel=np.ones(n, np.uint8),
              op_cost=np.array(r.cost, np.float64), inputs_start=starts(r.ins),
              inputs=np.array([v for x in r.ins for v in x], np.int32), outputs_start=starts(r.outs),
              outputs=np.array([v for x in r.outs for v in x], np.int32), value_bytes=np.array(r.value_bytes, np.int64),
              value_producer=np.array(r.producer, np.int32), value_recomputable=np.array(r.recipe, np.uint8),
              value_free_at=free_at, value_overwrites=np.full(m, -1, np.int32), backward_at=r.backward_at,
              meta={"source": "simrd"})
    t.check("simrd log")
    return t


def load_simrd(path: str, time_unit: float = 1e-6) -> Trace:
    with open(path) as f:
        return read_simrd(f, time_unit)
