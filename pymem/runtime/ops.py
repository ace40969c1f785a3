"""What the runtime must know about an aten op, computed once per OpOverload from its schema and tags."""
from typing import Dict, List, Tuple

import torch

from .. import _C

aten = torch.ops.aten

# Ops whose effect is not a pure function of their tensor arguments, or that change a storage's
# identity or size: their outputs are never recomputed.
_NEVER_RECOMPUTE = {
    aten.set_.source_Storage, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor, aten.set_.default,
    aten.resize_.default, aten.resize_as_.default, aten._resize_output_.default, aten.record_stream.default,
    aten._local_scalar_dense.default, aten.lift_fresh.default, aten.lift_fresh_copy.default,
}
_PURE_NAMESPACES = ("aten", "prims")
# Collectives: their schemas mark no argument as written (c10d::allreduce_ writes its tensors), and a
# communication thread may still read or write their buffers after the op returns (see in_flight).
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                          "symm_mem")

# Ops that write arguments their schema does not mark as written: the legacy batch norms update
# running_mean and running_var (positions 3 and 4) in training mode, in every overload (.out too).
_HIDDEN_WRITES = {
    getattr(aten, name): [(3, "running_mean"), (4, "running_var")]
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm") if hasattr(aten, name)
}

# In-place ops that overwrite every element of their first argument without reading it: when the
# mutated view covers the whole storage, the recompute starts from a blank buffer, so the old value
# (and its recompute chain) is never needed.
_OVERWRITE_NAMES = {"zero_", "fill_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
                    "geometric_", "cauchy_", "log_normal_", "copy_"}


def overwrites_unread(op_name: str) -> bool:
    """Whether the op named ``op_name`` (``str(OpOverload)``, as step traces name ops: "aten.fill_.Scalar")
    overwrites its first argument without reading it (its recompute starts from a blank buffer when
    the write covers the whole storage); an in-place op that reads it (``div_``, ``add_``) does not."""
    parts = op_name.split(".")
    return len(parts) > 1 and parts[1] in _OVERWRITE_NAMES


class OpInfo:
    __slots__ = ("name", "code", "mutated", "regrown", "seeded", "pure", "overwrites", "fresh_returns", "collective",
                 "async_pos")

    def __init__(self, func) -> None:
        schema = func._schema
        tags = func.tags
        self.name = str(func)
        self.code = _C.op_code(self.name)  # in step traces
        # (position, name) of arguments the op writes. inplace_view ops (t_, squeeze_, ...) only change
        # a tensor's view metadata, never storage bytes: records are per storage, so they mutate nothing.
        written = [(i, a.name) for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        view_op = torch.Tag.inplace_view in tags
        self.mutated: List[Tuple[int, str]] = [] if view_op else list(written)
        self.mutated.extend(_HIDDEN_WRITES.get(func.overloadpacket, ()))
        # Except that resize_ and resize_as_ give a storage too small for the new shape a larger buffer
        # (its old bytes copied): arguments whose storage may grow though the op writes no byte.
        self.regrown: List[Tuple[int, str]] = written if view_op else []
        self.seeded = torch.Tag.nondeterministic_seeded in tags
        self.pure = func.namespace in _PURE_NAMESPACES and func not in _NEVER_RECOMPUTE
        self.overwrites = overwrites_unread(self.name) and len(self.mutated) == 1
        self.fresh_returns = any(r.alias_info is None for r in schema.returns)
        self.collective = func.namespace in _COLLECTIVE_NAMESPACES
        self.async_pos = next((i for i, a in enumerate(schema.arguments) if a.name == "async_op"), None)


_cache: Dict[object, OpInfo] = {}


def covers_storage(t, nbytes: int) -> bool:
    """Whether tensor ``t`` spans all ``nbytes`` of its storage, contiguously from its start: an op
    that overwrites it unread (OpInfo.overwrites) then leaves no old byte, and its recompute starts
    from a blank buffer (Runtime._refs; the simulator's capture applies the same rule)."""
    return t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == nbytes


def op_info(func) -> OpInfo:
    info = _cache.get(func)
    if info is None:
        info = _cache[func] = OpInfo(func)
    return info


def mutated_tensors(positions: List[Tuple[int, str]], args, kwargs) -> List[torch.Tensor]:
    """The tensors at ``positions`` (OpInfo.mutated, OpInfo.regrown; lists of tensors flattened)."""
    out = []
    for pos, name in positions:
        v = args[pos] if pos < len(args) else kwargs.get(name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def in_flight(info: OpInfo, args, kwargs) -> bool:
    """A collective whose buffers its communication thread may still read or write once it returned:
    all but those called with async_op=False, which torch.distributed waits for before returning to
    its caller (FSDP2's reduce-scatter). Work completion is not polled instead: gloo's reduce-scatter
    Work never reports it, and callbacks chained on a Work may still write after it does."""
    if not info.collective:
        return False
    pos = info.async_pos
    if pos is None:
        return True
    return (args[pos] if pos < len(args) else kwargs.get("async_op", True)) is not False
