"""Budget strings: ``"20GB"``, ``"20GiB"``, ``"512MB"``, ``"1.5TB"``, ``"80%"``, or an int of bytes.

Units: decimal (kB = 1000, MB = 1000**2, GB, TB) and binary (KiB = 1024, MiB = 1024**2, GiB, TiB),
as the IEC prefixes say; ``B`` or no unit means bytes. Case is ignored and a space may separate the
number from the unit. ``"N%"`` is N percent of the device's total memory (NVML on a GPU, the
machine's physical memory on the CPU). The result is rounded down to the arena's 512-byte
granularity, so the budget never grows.
"""
import os
import re
from typing import Optional, Union

ALIGNMENT = 512
_UNITS = {"": 1, "b": 1,
          "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*|%)\s*$", re.IGNORECASE)
ACCEPTED = ('an int of bytes, or a string like "20GB", "20GiB", "512MB", "1.5TB", "4096" or "80%" '
            "(units: B, kB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024; "
            "N% = N percent of the device's total memory)")


def device_total_memory(device: str) -> int:
    """Total memory of ``device``: NVML for ``cuda[:i]``, physical memory for ``cpu``."""
    if device.startswith("cuda"):
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            index = int(device.split(":")[1]) if ":" in device else 0
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).total)
        finally:
            pynvml.nvmlShutdown()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_host_budget(host_budget: Union[None, int, str], total: Optional[int] = None) -> Optional[int]:
    """Bytes for ``host_budget`` (the cap on host memory holding offloaded values), or None for no
    cap; ``"N%"`` is N percent of the machine's physical memory. Raises ValueError naming it."""
    if host_budget is None:
        return None
    try:
        return parse_budget(host_budget, "cpu", total)
    except ValueError as e:
        raise ValueError(f"host_{e} (None: no cap)") from None


def parse_budget(budget: Union[int, str], device: str = "cpu", total: Optional[int] = None) -> int:
    """Bytes for ``budget`` (see the module doc), rounded down to 512. ``total`` overrides the
    device's memory for ``"N%"``. Raises ValueError quoting the bad value and the accepted forms."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise ValueError(f"budget {budget!r} is not accepted: expected {ACCEPTED}")
    if isinstance(budget, int):
        n = budget
    else:
        m = _PATTERN.match(budget)
        unit = m.group(2).lower() if m else None
        if m is None or (unit not in _UNITS and unit != "%"):
            raise ValueError(f"budget {budget!r} is not accepted: expected {ACCEPTED}")
        value = float(m.group(1))
        if unit == "%":
            if not 0 < value <= 100:
                raise ValueError(f"budget {budget!r} is not accepted: a percentage must be in (0, 100]")
            n = int(value / 100 * (total if total is not None else device_total_memory(device)))
        else:
            n = int(value * _UNITS[unit])
    n -= n % ALIGNMENT
    if n <= 0:
        raise ValueError(f"budget {budget!r} is below the arena's granularity of {ALIGNMENT} bytes; "
                         f"expected {ACCEPTED}")
    return n


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units), for summaries and the CLI."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
