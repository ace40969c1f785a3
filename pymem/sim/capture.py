"""Capture one training step as a Trace (trace.py) without allocating memory: run it on the meta
device under a dispatch mode that books every aten op.

What each op tells the mode: its inputs' and outputs' storages (a storage seen for the first time as
an output is a fresh value; one already known is a view of it, no value), the arguments its schema
marks as written (an in-place op makes a new value of the same storage, which takes over its
bytes), FLOPs (torch's counter, ``pymem.cost_model.op_flops``) and the bytes its tensors span. A
storage's death is seen exactly: on meta, torch keeps one Python object per storage, and a
``weakref.finalize`` on it runs when the storage itself is freed (autograd's saved tensors keep it
alive until the backward pass has read them, as on a GPU). The first op that runs inside an
autograd node marks the backward pass.

Recipes (``value_recomputable``), as the runtime gives them: a value made in the step can be
recomputed unless a backward op made it (gradients are leaves from birth), an op writing outside
autograd made it (the optimizer's updates), it rewrote a leaf in place, or it is still alive when
the step ends (what the next step reads).
"""
import weakref
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..cost_model import op_flops, tensor_bytes
from ..runtime.ops import covers_storage, op_info
from .trace import Trace

_HALF = (torch.bfloat16, torch.float16)
_SCALAR = torch.ops.aten._local_scalar_dense.default


class _Booking(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: Dict[str, int] = {}
        self.op: List[int] = []
        self.flops: List[int] = []
        self.nbytes: List[int] = []
        self.fp32: List[int] = []
        self.kernel: List[int] = []
        self.recipes: List[bool] = []
        self.ins: List[List[int]] = []
        self.outs: List[List[int]] = []
        self.value_bytes: List[int] = []
        self.producer: List[int] = []
        self.free_at: List[int] = []
        self.overwrites: List[int] = []
        self.blank: List[int] = []  # value_blank_rerun
        self.current: Dict[int, int] = {}  # id(storage) -> its value now
        self.backward_at = -1
        self.closed = False
        self.booking = True  # False: ops run unbooked (a script's steps before the traced one)
        self._finalizers: List[weakref.finalize] = []

    # --- values ---
    def _died(self, key: int) -> None:
        v = self.current.pop(key, None)
        if v is not None and not self.closed:
            self.free_at[v] = max(len(self.op) - 1, 0)

    def _new_value(self, storage, key: int, producer: int, overwrites: int = -1, blank: bool = False) -> int:
        v = len(self.value_bytes)
        self.value_bytes.append(int(storage.nbytes()))
        self.producer.append(producer)
        self.free_at.append(-1)
        self.overwrites.append(overwrites)
        self.blank.append(int(blank))
        if overwrites >= 0:
            self.free_at[overwrites] = producer  # its bytes are v's from here
        else:
            self._finalizers.append(weakref.finalize(storage, self._died, key))
        self.current[key] = v
        return v

    def _value_of(self, t: torch.Tensor) -> int:
        s = t.untyped_storage()
        v = self.current.get(id(s))
        return v if v is not None else self._new_value(s, id(s), -1)

    # --- ops ---
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SCALAR and args[0].is_meta:
            # .item() on meta: there is no value. 1 lets logging go on, and what divides by a count
            # or by an optimizer's bias correction 1 - beta ** step (Adam's, where its step counter
            # is read as a number: a ZeroDivisionError at 0); a flag reads False.
            return 1.0 if args[0].dtype.is_floating_point else (False if args[0].dtype == torch.bool else 1)
        if not self.booking:
            return func(*args, **kwargs)
        flat_in = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        ins: List[int] = []
        for t in flat_in:  # read before the op runs: a pre-step value first seen here is an input
            v = self._value_of(t)
            if v not in ins:
                ins.append(v)
        out = func(*args, **kwargs)
        k = len(self.op)
        if self.backward_at < 0 and torch._C._current_autograd_node() is not None:
            self.backward_at = k
        outs: List[int] = []
        written = False
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            written = True
            x = kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) else None
            for t in (x if isinstance(x, (list, tuple)) else (x,)):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    old = self.current.get(id(s))
                    if old is not None and old not in outs:
                        blank = op_info(func).overwrites and covers_storage(t, s.nbytes())  # the runtime's blank
                        outs.append(self._new_value(s, id(s), k, overwrites=old, blank=blank))
        flat_out = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        fresh = False
        for o in flat_out:
            s = o.untyped_storage()
            if id(s) not in self.current:
                outs.append(self._new_value(s, id(s), k))
                fresh = True
        name = str(func)
        self.op.append(self.names.setdefault(name, len(self.names)))
        self.flops.append(op_flops(func, args, kwargs, out))
        self.nbytes.append(tensor_bytes(flat_in) + tensor_bytes(flat_out))
        floats = [t.dtype for t in flat_in + flat_out if t.dtype.is_floating_point]
        self.fp32.append(int(bool(floats) and not any(d in _HALF for d in floats)))
        self.kernel.append(int(fresh or written))
        # The runtime's rule (runtime.run_op): backward ops (a graph task runs them) get no recipes,
        # nor does an op that writes a tensor outside autograd (an optimizer's update).
        self.recipes.append(torch.is_grad_enabled() or (torch._C._current_graph_task_id() < 0 and not written))
        self.ins.append(ins)
        self.outs.append(outs)
        return out

    def trace(self, meta: Dict) -> Trace:
        self.closed = True
        for f in self._finalizers:
            f.detach()
        n, m = len(self.op), len(self.value_bytes)
        producer = np.array(self.producer, dtype=np.int32)
        free_at = np.array(self.free_at, dtype=np.int32)
        overwrites = np.array(self.overwrites, dtype=np.int32)
        alive = np.zeros(m, dtype=bool)
        alive[list(self.current.values())] = True
        free_at[alive] = -1
        recomputable = (producer >= 0) & ~alive
        recomputable[producer >= 0] &= np.array(self.recipes, dtype=bool)[producer[producer >= 0]]
        for v in range(m):  # in place on a leaf: a leaf (in value order: an old version comes first)
            w = overwrites[v]
            if w >= 0 and not recomputable[w]:
                recomputable[v] = False
        t = Trace(op_names=list(self.names), op=np.array(self.op, np.int32), op_flops=np.array(self.flops, np.int64),
                  op_bytes=np.array(self.nbytes, np.int64), op_fp32=np.array(self.fp32, np.uint8),
                  op_kernel=np.array(self.kernel, np.uint8), op_cost=np.full(n, np.nan),
                  inputs_start=_starts(self.ins), inputs=_flat(self.ins), outputs_start=_starts(self.outs),
                  outputs=_flat(self.outs), value_bytes=np.array(self.value_bytes, np.int64), value_producer=producer,
                  value_recomputable=recomputable.astype(np.uint8), value_free_at=free_at,
                  value_overwrites=overwrites, backward_at=self.backward_at, meta=meta,
                  value_blank_rerun=np.array(self.blank, np.uint8))
        t.check("captured step")
        return t


def _starts(lists: List[List[int]]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([len(x) for x in lists], dtype=np.int64)]).astype(np.int64)


def _flat(lists: List[List[int]]) -> np.ndarray:
    return np.array([v for x in lists for v in x], dtype=np.int32)


def capture(step: Callable[[], object], meta: Optional[Dict] = None) -> Trace:
    """Run ``step()`` (one training step, on meta tensors) once under the booking mode: its Trace.
    Run one step before it untraced when the optimizer makes its state lazily (Adam), so the traced
    step is one like every later step."""
    booking = _Booking()
    with booking:
        step()
    return booking.trace(dict(meta or {}))


def capture_model(name: str, batch: Optional[int] = None, dtype: torch.dtype = torch.bfloat16) -> Trace:
    """The Trace of one training step of a built-in model or hf:CONFIG (models.py), after one
    untraced step (AdamW makes its state in the first)."""
    from .models import model_step

    step, meta = model_step(name, batch=batch, dtype=dtype)
    step()
    return capture(step, meta)


class _Traced(Exception):
    """Raised out of the script's optimizer step once its traced step is complete."""


def _gpu_attention(sdpa: Callable) -> Callable:
    """``F.scaled_dot_product_attention`` on meta tensors as a GPU runs it: one fused kernel (flash
    for fp16/bf16 without a mask; memory-efficient attention otherwise, fp32 included), not the math
    path (a seq x seq score matrix, softmax, matmuls) that the meta device takes. Calls it does not
    cover (GQA, boolean masks, not 4-d, not meta) go to ``sdpa`` unchanged."""
    aten = torch.ops.aten

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if (not query.is_meta or enable_gqa or query.dim() != 4 or query.is_nested
                or (attn_mask is not None and (is_causal or attn_mask.dtype != query.dtype))):
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        if query.dtype in _HALF and attn_mask is None:
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, grad, dropout_p, is_causal,
                                                            scale=scale)[0]

    return attention


def capture_script(path: str, argv: Optional[List[str]] = None, meta: Optional[Dict] = None) -> Trace:
    """The Trace of a training script's second step (between the ends of its first and second
    optimizer steps), run with the meta device as the default device. The script must make its
    tensors on the default device (no ``.cuda()``); ``.item()`` reads 1 (a flag False), so data-dependent control
    flow follows one branch. Attention (``F.scaled_dot_product_attention``) runs the fused kernel a
    GPU would pick. The script stops once the step is traced."""
    import runpy
    import sys

    import torch.nn.functional as F

    booking = _Booking()
    booking.booking = False
    steps = [0]

    def after_step(optimizer, args, kwargs):
        steps[0] += 1
        if steps[0] == 1:
            booking.booking = True
        elif steps[0] == 2:
            raise _Traced()

    import torch.utils._device as torch_device
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(after_step)
    # None when no default device was set: restoring get_default_device()'s "cpu" instead would leave a
    # device mode on torch's function-mode stack for the rest of the process (every call through it).
    old_argv, old_device, old_sdpa = sys.argv, torch_device.CURRENT_DEVICE, F.scaled_dot_product_attention
    sys.argv = [path, *(argv or [])]
    torch.set_default_device("meta")
    F.scaled_dot_product_attention = _gpu_attention(old_sdpa)
    try:
        with booking:
            runpy.run_path(path, run_name="__main__")
    except _Traced:
        pass
    finally:
        handle.remove()
        F.scaled_dot_product_attention = old_sdpa
        torch.set_default_device(old_device)
        sys.argv = old_argv
    if steps[0] < 2:
        raise ValueError(f"{path}: the script ended after {steps[0]} optimizer step(s); a trace needs two "
                         f"(the second is traced: the first makes the optimizer's state)")
    return booking.trace(dict(meta or {}, model=path))
