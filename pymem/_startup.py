"""Activation from the environment: ``PYMEM_BUDGET=20GB python train.py`` runs an unchanged script
under pymem.

The package installs ``torch_pymem_startup.pth`` into site-packages (see setup.py). Python runs its
one line at every start; the line imports this module only when ``PYMEM_BUDGET`` is set, so an
interpreter without it pays one environment lookup and never imports torch. The variables:

  PYMEM_BUDGET   the budget, in any form ``pymem.parse_budget`` accepts ("20GB", "80%", ...)
  PYMEM_POLICY   the eviction policy (default ``dtr``)
  PYMEM_DEVICE   ``cpu`` or ``cuda`` (default: CUDA when available, else CPU)
  PYMEM_ALLOCATOR ``arena`` (the default) or ``native`` (see ``pymem.enable``)
  PYMEM_OFFLOAD  ``delta`` (the CUDA default), ``never`` (the CPU default) or ``always``
  PYMEM_PREFETCH ``1`` (the default) or ``0``
  PYMEM_PLAN     ``auto`` (the default) or ``off``
  PYMEM_HOST_BUDGET  a cap on host memory for offloaded values ("64GB", "50%" of RAM; default none)
  PYMEM_OFFLOAD_LEAVES ``1`` or ``0``: offload values with no recipe (default: when offloading)
  PYMEM_LOG      ``debug``, ``info``, ``warning`` or ``error``: pymem's log to stderr at that level
                 (at ``info``, a summary line when the program ends)

A malformed value stops the program here, with a message naming the variable and exit code 2,
before the script's first line runs, never halfway through training. Child Python processes
inherit the variables, so each one (a spawned DataLoader worker too) gets its own budget.
"""
import os
import sys
from typing import Dict, Mapping

EXIT_BAD_SETTING = 2
LOG_LEVELS = ("debug", "info", "warning", "error")


def settings_from_env(environ: Mapping[str, str]) -> Dict[str, object]:
    """``enable()``'s keyword arguments from the PYMEM_* variables; ValueError naming the variable
    and the accepted values on anything malformed."""
    from .budget import parse_budget, parse_host_budget
    from .policies import director_names, policy_names
    from .runtime.settings import ALLOCATORS

    raw = environ.get("PYMEM_BUDGET", "")
    settings: Dict[str, object] = {}
    device = environ.get("PYMEM_DEVICE", "").strip() or None
    if device is not None and device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"PYMEM_DEVICE={device!r} is not a device; accepted: 'cpu', 'cuda', 'cuda:N'")
    settings["device"] = device
    try:
        settings["budget"] = parse_budget(raw, _device_for_percent(device))
    except ValueError as e:
        raise ValueError(f"PYMEM_BUDGET: {e}") from None
    policy = environ.get("PYMEM_POLICY", "").strip() or "dtr"
    if policy not in policy_names():
        raise ValueError(f"PYMEM_POLICY={policy!r} is not a policy; accepted: {', '.join(policy_names())}")
    settings["policy"] = policy
    allocator = environ.get("PYMEM_ALLOCATOR", "").strip() or None  # None: by device (pymem.enable)
    if allocator is not None and allocator not in ALLOCATORS:
        raise ValueError(f"PYMEM_ALLOCATOR={allocator!r} is not an allocator; accepted: {', '.join(ALLOCATORS)}")
    settings["allocator"] = allocator
    offload = environ.get("PYMEM_OFFLOAD", "").strip() or None  # None: by device
    if offload is not None and offload not in director_names():
        raise ValueError(f"PYMEM_OFFLOAD={offload!r} is not accepted; accepted: {', '.join(director_names())}")
    settings["offload"] = offload
    prefetch = environ.get("PYMEM_PREFETCH", "").strip() or "1"
    if prefetch not in ("0", "1"):
        raise ValueError(f"PYMEM_PREFETCH={prefetch!r} is not accepted; accepted: 0, 1")
    settings["prefetch"] = prefetch == "1"
    host = environ.get("PYMEM_HOST_BUDGET", "").strip() or None  # None: no cap
    try:
        settings["host_budget"] = parse_host_budget(host)
    except ValueError as e:
        raise ValueError(f"PYMEM_HOST_BUDGET: {e}") from None
    leaves = environ.get("PYMEM_OFFLOAD_LEAVES", "").strip() or None  # None: by offload
    if leaves is not None and leaves not in ("0", "1"):
        raise ValueError(f"PYMEM_OFFLOAD_LEAVES={leaves!r} is not accepted; accepted: 0, 1")
    settings["offload_leaves"] = None if leaves is None else leaves == "1"
    plan = environ.get("PYMEM_PLAN", "").strip() or "auto"
    if plan not in ("auto", "off"):
        raise ValueError(f"PYMEM_PLAN={plan!r} is not accepted; accepted: auto, off")
    settings["plan"] = plan
    level = environ.get("PYMEM_LOG", "").strip().lower()
    if level and level not in LOG_LEVELS:
        raise ValueError(f"PYMEM_LOG={environ['PYMEM_LOG']!r} is not a log level; accepted: {', '.join(LOG_LEVELS)}")
    settings["log"] = level or None
    return settings


def _device_for_percent(device) -> str:
    if device is not None:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _configure_log(level: str) -> None:
    import logging

    log = logging.getLogger("pymem")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    log.addHandler(handler)
    log.setLevel(level.upper())


def _summary_at_exit() -> None:
    import logging

    import pymem

    log = logging.getLogger("pymem")
    s = pymem.memory_stats()
    if s:
        log.info("at exit: peak %s of a %s budget, %d evictions, %d rematerializations (%.3f s)",
                 pymem.api.format_bytes(s["allocated_bytes.peak"]), pymem.api.format_bytes(s["budget_bytes"]),
                 s.get("num_evictions", 0), s.get("num_rematerializations", 0), s.get("remat_seconds", 0.0))


def activate(environ: Mapping[str, str] = os.environ) -> None:
    """Enable pymem from the environment, or stop the program with a clear message."""
    try:
        settings = settings_from_env(environ)
        level = settings.pop("log")
        if level:
            _configure_log(level)
        import atexit

        import pymem

        pymem.enable(**settings)
        atexit.register(_summary_at_exit)
    except Exception as e:  # noqa: BLE001 — any failure here must stop the program, not half-start it
        sys.stderr.write(f"pymem: cannot start from the environment: {e}\n")
        sys.stderr.flush()
        # os._exit: a SystemExit raised while site.py runs .pth lines would not stop every interpreter.
        os._exit(EXIT_BAD_SETTING)


if os.environ.get("PYMEM_BUDGET"):
    activate()
