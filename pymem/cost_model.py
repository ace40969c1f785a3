"""Op cost without a host timer: a roofline estimate calibrated once per device.

On CUDA a host timer around an op measures its launch, not its kernel (launches are asynchronous),
so the runtime prices ops with ``launch + max(flops / flop_rate, bytes / byte_rate)`` instead:
FLOPs from ``torch.utils.flop_counter``'s registry (matmuls, convolutions, attention; zero for the
rest), bytes as the sum of the input and output tensors' sizes. The three rates come from timing a
matmul, a large add and a one-element add on the device once per process (CUDA events on a GPU,
the host clock on the CPU, where ops are synchronous). Estimates are also repeatable: with fixed
rates the same program makes the same eviction decisions on every run, which measured times cannot
promise.

This module knows nothing of the runtime; the runtime and the simulator both price ops with it.
"""
import functools
import time
from typing import Dict, Optional, Sequence

import numpy as np
import torch
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# Variants the registry does not list that take (query, key, value, ...) like the ones it does.
_FLOP_ALIASES = {
    "_scaled_dot_product_flash_attention_for_cpu": aten._scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention_for_cpu_backward": aten._scaled_dot_product_flash_attention_backward,
}


@functools.lru_cache(maxsize=None)
def _flop_formula(packet):
    """The registry's formula on shapes (unwrapped: the wrapper's pytree walk costs ~14 us/op)."""
    f = flop_registry.get(packet)
    if f is None:
        alias = _FLOP_ALIASES.get(packet.__name__)
        f = flop_registry.get(alias) if alias is not None else None
    return getattr(f, "__wrapped__", None) if f is not None else None


def _shape(a):
    if isinstance(a, torch.Tensor):
        return a.shape
    if a.__class__ is list or a.__class__ is tuple:
        return a.__class__(_shape(x) for x in a)
    return a


_flops_seen: Dict[tuple, int] = {}


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one aten op call by torch's FLOP counter formulas; 0 for ops it does not price.
    Memoized on the op and its arguments' shapes: a formula calls others through the registry's
    pytree wrapper (~30 us), and a training step repeats the same shapes every iteration."""
    f = _flop_formula(func.overloadpacket)
    if f is None:
        return 0
    shapes = tuple(_shape(a) for a in args)
    kw = tuple((k, _shape(v)) for k, v in kwargs.items()) if kwargs else ()
    key = (func, shapes, kw)
    try:
        flops = _flops_seen.get(key)
    except TypeError:  # an unhashable argument: not memoized
        key, flops = None, None
    if flops is None:
        try:
            flops = int(f(*shapes, out_shape=_shape(out), **dict(kw)))
        except Exception:  # a formula that does not accept this overload's arguments: price by bytes
            flops = 0
        if key is not None:
            if len(_flops_seen) >= 1 << 16:
                _flops_seen.clear()
            _flops_seen[key] = flops
    return flops


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes the tensors span as viewed (numel * element size), the traffic of reading them once."""
    n = 0
    for t in tensors:
        n += t.numel() * t.element_size()
    return n


class CostModel:
    """``seconds(func, args, kwargs, ins, out)``: the estimated run time of one op call.

    flop_rate: FLOP/s of a large matmul; byte_rate: bytes/s of a large elementwise op (read + write);
    launch: seconds of a one-element op (the floor every op pays)."""

    __slots__ = ("flop_rate", "byte_rate", "launch", "device")

    def __init__(self, flop_rate: float, byte_rate: float, launch: float, device: str = "cpu") -> None:
        for name, v in (("flop_rate", flop_rate), ("byte_rate", byte_rate)):
            if not v > 0:
                raise ValueError(f"CostModel {name} must be positive, got {v!r}")
        if not launch >= 0:
            raise ValueError(f"CostModel launch must be >= 0, got {launch!r}")
        self.flop_rate, self.byte_rate, self.launch, self.device = float(flop_rate), float(byte_rate), float(launch), device

    def seconds(self, func, args, kwargs, ins: Sequence[torch.Tensor], out) -> float:
        outs = (out,) if isinstance(out, torch.Tensor) else \
            [o for o in out if isinstance(o, torch.Tensor)] if isinstance(out, (tuple, list)) else ()
        moved = tensor_bytes(ins) + tensor_bytes(outs)
        return self.launch + max(op_flops(func, args, kwargs, out) / self.flop_rate, moved / self.byte_rate)

    def price(self, flops: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """``seconds``' formula over arrays of FLOPs and bytes (the simulator prices a whole trace
        at once); ``seconds`` keeps it inline, as it runs for every op."""
        return self.launch + np.maximum(flops / self.flop_rate, nbytes / self.byte_rate)

    def __repr__(self) -> str:
        return (f"CostModel({self.device}: {self.flop_rate / 1e9:.1f} GFLOP/s, {self.byte_rate / 1e9:.1f} GB/s, "
                f"launch {self.launch * 1e6:.1f} us)")


_calibrated: Dict[str, CostModel] = {}


def calibrated(device: str = "cpu") -> CostModel:
    """The device's CostModel, timed on first use and kept for the process (enable/disable cycles
    do not pay for it again). Call it before pymem's allocator is installed: its buffers are
    ordinary PyTorch allocations."""
    dev = _concrete(device)
    model = _calibrated.get(str(dev))
    if model is None:
        model = _calibrated[str(dev)] = _calibrate(dev)
    return model


def _concrete(device: str) -> torch.device:
    """``device`` with "cuda" pinned to the current device: per-device caches key on it."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _timer(device: torch.device):
    """best(fn, reps) -> seconds of one call, best of a few: device time (events) on CUDA."""
    if device.type == "cuda":
        def best(fn, reps):
            fn()
            torch.cuda.synchronize(device)
            times = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return min(times)
    else:
        def best(fn, reps):
            fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)
    return best


def _calibrate(device: torch.device, matmul_n: Optional[int] = None, add_numel: Optional[int] = None) -> CostModel:
    best = _timer(device)
    gpu = device.type == "cuda"
    n = matmul_n or (2048 if gpu else 256)
    m = add_numel or (1 << 24)  # 64 MiB per operand: past the caches, as activations are
    with torch.no_grad():
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        mm = best(lambda: torch.mm(a, b), 5)
        x, y = torch.ones(m, device=device), torch.ones(m, device=device)
        add = best(lambda: torch.add(x, y), 5)
        s = torch.ones(1, device=device)
        launch = best(lambda: torch.add(s, s), 20)
    flop_rate = 2 * n ** 3 / max(mm - launch, 1e-9)
    byte_rate = 3 * m * 4 / max(add - launch, 1e-9)
    return CostModel(flop_rate, byte_rate, launch, str(device))


_bandwidth: Dict[str, float] = {}


def host_link_bandwidth(device: str = "cpu") -> float:
    """Bytes per second of one copy between the device and host memory (what offloading a value or
    bringing it back costs): timed once per process, like ``calibrated``, before pymem's allocator
    is installed. CUDA: device to pinned host memory. CPU: host to host (the CPU device's "offload"
    copies into host buffers outside the arena)."""
    dev = _concrete(device)
    bw = _bandwidth.get(str(dev))
    if bw is None:
        n = 32 << 20
        best = _timer(dev)
        if dev.type == "cuda":
            src = torch.empty(n, dtype=torch.uint8, device=dev)
            dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        else:
            src = torch.from_numpy(np.ones(n, dtype=np.uint8))
            dst = torch.from_numpy(np.empty(n, dtype=np.uint8))
        with torch.no_grad():
            seconds = best(lambda: dst.copy_(src), 5)
        bw = _bandwidth[str(dev)] = n / max(seconds, 1e-9)
    return bw


def host_copy_bandwidth() -> float:
    """Bytes per second of one copy within host memory (what moving a block costs when the CPU
    device compacts its arena), timed once per process with NumPy alone: no torch op, so the runtime
    may ask while it manages ops."""
    bw = _bandwidth.get("host copy")
    if bw is None:
        n = 32 << 20
        a, b = np.ones(n, dtype=np.uint8), np.ones(n, dtype=np.uint8)
        seconds = _timer(torch.device("cpu"))(lambda: np.copyto(b, a), 5)
        bw = _bandwidth["host copy"] = n / max(seconds, 1e-9)
    return bw
