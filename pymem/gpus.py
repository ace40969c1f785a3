"""GPU cost models as data (issue 16, item 2): published peak rates of the GPUs pymem's users train
on, priced the way the runtime prices ops without a timer (``pymem.cost_model.CostModel``:
``launch + max(flops / flop_rate, bytes / byte_rate)``), for what runs where no such GPU is at hand
(the simulator, budgets planned before renting one).

Rates are the vendors' datasheet peaks, dense (no structured sparsity): tensor-core FLOP/s for
bf16/fp16, the non-tensor-core rate for fp32; memory bandwidth of the device's HBM or GDDR; the host
link per direction, one copy queue each way (a copy out and a copy back can overlap, two copies the
same way cannot). Sources: third_party/README.md ("GPUs"). ``LAUNCH_SECONDS`` is not a published
figure: it is the order of a kernel launch from PyTorch's eager mode, and a calibration on a lent
GPU replaces it. Peaks overstate what real kernels reach; the same calibration measures by how much.
"""
from dataclasses import dataclass
from typing import Dict, List

import torch

from .cost_model import CostModel

LAUNCH_SECONDS = 4e-6


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    tensor_flops: float      # bf16 / fp16 dense, FLOP/s
    fp32_flops: float        # fp32 without tensor cores, FLOP/s
    memory_bytes_per_s: float
    host_link: str
    host_bytes_per_s: float  # per direction


GPUS: Dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("h100", 80 * 10**9, 989.5e12, 67e12, 3.35e12, "PCIe 5.0 x16", 64e9),
    GpuSpec("h200", 141 * 10**9, 989.5e12, 67e12, 4.8e12, "PCIe 5.0 x16", 64e9),
    GpuSpec("gh200", 96 * 10**9, 989.5e12, 67e12, 4.0e12, "NVLink-C2C", 450e9),
    GpuSpec("a100", 80 * 10**9, 312e12, 19.5e12, 2.039e12, "PCIe 4.0 x16", 32e9),
    GpuSpec("l4", 24 * 10**9, 121e12, 30.3e12, 300e9, "PCIe 4.0 x16", 32e9),
)}

_TENSOR_DTYPES = (torch.bfloat16, torch.float16)


def gpu_names() -> List[str]:
    return sorted(GPUS)


def gpu_spec(name: str) -> GpuSpec:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; accepted: {', '.join(gpu_names())}") from None


def gpu_cost_model(name: str, dtype: torch.dtype = torch.bfloat16, launch: float = LAUNCH_SECONDS) -> CostModel:
    """The CostModel of GPU ``name`` for a model computing in ``dtype`` (bf16/fp16: tensor cores;
    fp32: without them)."""
    g = gpu_spec(name)
    if dtype in _TENSOR_DTYPES:
        flops = g.tensor_flops
    elif dtype == torch.float32:
        flops = g.fp32_flops
    else:
        raise ValueError(f"no rate for dtype {dtype}; accepted: torch.bfloat16, torch.float16, torch.float32")
    return CostModel(flops, g.memory_bytes_per_s, launch, device=name)


def copy_seconds(name: str, nbytes: int) -> float:
    """One copy of ``nbytes`` between GPU ``name`` and pinned host memory, one direction."""
    return nbytes / gpu_spec(name).host_bytes_per_s
