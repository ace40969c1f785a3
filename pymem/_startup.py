"""Activation from the environment: ``PYMEM_BUDGET=20GB python train.py`` runs an unchanged script
under pymem.

The package installs ``torch_pymem_startup.pth`` into site-packages (see setup.py). Python runs its
one line at every start; the line imports this module only when ``PYMEM_BUDGET`` is set. What
happens when:

- at start-up, before the script's first line: every ``PYMEM_*`` variable is read and checked,
  without importing torch (nor numpy): a malformed value stops the program here, with a message
  naming the variable and exit code 2, never halfway through training;
- then an import hook is armed (``pymem.import_hook``), and nothing more: a process that never
  imports torch (``pip``, a helper script, a tool written in Python) pays for the lookup and the
  checks only;
- when the program imports torch, pymem is enabled right after torch's own module has run, before
  the ``import torch`` statement returns, so before anything can initialise CUDA. A setting only
  the device can judge (a percentage of its memory, ``cuda`` with no GPU) is judged there, and a
  bad one stops the program the same way. If torch was imported before the hook (another .pth
  file), pymem is enabled at once.

The variables:

  PYMEM_BUDGET   the budget, in any form ``pymem.parse_budget`` accepts ("20GB", "80%", ...)
  PYMEM_POLICY   the eviction policy (default ``dtr``)
  PYMEM_DEVICE   ``cpu`` or ``cuda`` (default: CUDA when available, else CPU)
  PYMEM_ALLOCATOR ``arena`` (the default) or ``native`` (see ``pymem.enable``)
  PYMEM_OFFLOAD  ``delta`` (the CUDA default), ``never`` (the CPU default) or ``always``
  PYMEM_PREFETCH ``1`` (the default) or ``0``
  PYMEM_PLAN     ``auto`` (the default) or ``off``
  PYMEM_HOST_BUDGET  a cap on host memory for offloaded values ("64GB", "50%" of RAM; default none)
  PYMEM_OFFLOAD_LEAVES ``1`` or ``0``: offload values with no recipe (default: when offloading)
  PYMEM_VERIFY   ``1`` or ``0`` (the default): check each released value as it comes back
  PYMEM_LOG      ``debug``, ``info``, ``warning`` or ``error``: pymem's log to stderr at that level
                 (at ``info``, a summary line when the program ends)

Child Python processes inherit the variables, so each one (a spawned DataLoader worker too) gets its
own budget. ``pymem run`` checks its flags with the same function and arms the same hook.
"""
import os
import sys
from typing import Callable, Dict, Mapping, Optional

from .budget import format_bytes, parse_budget, parse_host_budget
from .choices import ALLOCATORS, DIRECTORS, PLANS, POLICIES
from .import_hook import cancel, when_imported

EXIT_BAD_SETTING = 2
LOG_LEVELS = ("debug", "info", "warning", "error")

# enable()'s keyword -> its environment variable.
VARIABLES = {"budget": "PYMEM_BUDGET", "policy": "PYMEM_POLICY", "device": "PYMEM_DEVICE",
             "allocator": "PYMEM_ALLOCATOR", "offload": "PYMEM_OFFLOAD", "prefetch": "PYMEM_PREFETCH",
             "plan": "PYMEM_PLAN", "host_budget": "PYMEM_HOST_BUDGET", "offload_leaves": "PYMEM_OFFLOAD_LEAVES",
             "verify": "PYMEM_VERIFY", "log": "PYMEM_LOG"}


def settings_from_env(environ: Mapping[str, str]) -> Dict[str, object]:
    """``enable()``'s keyword arguments (and ``log``) from the PYMEM_* variables; ValueError naming
    the variable and the accepted values on anything malformed. Imports no torch."""
    return check_settings({key: environ.get(var, "") for key, var in VARIABLES.items()}, VARIABLES.__getitem__)


def check_settings(text: Mapping[str, Optional[str]], spelled: Callable[[str], str]) -> Dict[str, object]:
    """``enable()``'s keyword arguments (and ``log``) from settings given as text, each checked
    without importing torch: the environment's, or ``pymem run``'s flags. ``spelled(key)`` is how the
    user wrote the setting (``PYMEM_POLICY``, ``--policy``), for the messages. A missing or empty
    setting takes its default; a budget in percent is kept as text, for ``enable`` to take of the
    device it picks (its form and range are checked here)."""
    def given(key: str) -> Optional[str]:
        value = (text.get(key) or "").strip()
        return value or None

    def one_of(key: str, accepted, what: str = "") -> Optional[str]:
        value = given(key)
        if value is not None and value not in accepted:
            kind = f"is not {what}" if what else "is not accepted"
            raise ValueError(f"{spelled(key)}={value!r} {kind}; accepted: {', '.join(accepted)}")
        return value

    settings: Dict[str, object] = {}
    device = given("device")
    if device is not None and device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"{spelled('device')}={device!r} is not a device; accepted: 'cpu', 'cuda', 'cuda:N'")
    settings["device"] = device
    raw = given("budget") or ""
    try:
        if raw.endswith("%"):
            parse_budget(raw, total=1 << 62)  # the form and the range; the device's memory comes later
            settings["budget"] = raw
        else:
            settings["budget"] = parse_budget(raw)
    except ValueError as e:
        raise ValueError(f"{spelled('budget')}: {e}") from None
    settings["policy"] = one_of("policy", POLICIES, "a policy") or "dtr"
    settings["allocator"] = one_of("allocator", ALLOCATORS, "an allocator")  # None: by device (pymem.enable)
    settings["offload"] = one_of("offload", DIRECTORS)  # None: by device
    settings["prefetch"] = (one_of("prefetch", ("0", "1")) or "1") == "1"
    try:
        settings["host_budget"] = parse_host_budget(given("host_budget"))  # None: no cap
    except ValueError as e:
        raise ValueError(f"{spelled('host_budget')}: {e}") from None
    leaves = one_of("offload_leaves", ("0", "1"))  # None: by offload
    settings["offload_leaves"] = None if leaves is None else leaves == "1"
    settings["plan"] = one_of("plan", PLANS) or "auto"
    settings["verify"] = (one_of("verify", ("0", "1")) or "0") == "1"
    level = given("log")
    if level is not None and level.lower() not in LOG_LEVELS:
        raise ValueError(f"{spelled('log')}={level!r} is not a log level; accepted: {', '.join(LOG_LEVELS)}")
    settings["log"] = level.lower() if level else None
    return settings


def when_torch_imported(settings: Dict[str, object], fail: Callable[[Exception], None],
                        then: Callable[[], None] = lambda: None) -> Callable[[], None]:
    """``pymem.enable(**settings)`` right after the program's ``import torch`` (at once if torch is
    already imported), then ``then()``; ``fail(error)`` when enabling raises. Returns the callback
    (for ``import_hook.cancel``)."""
    def enable() -> None:
        try:
            import pymem

            pymem.enable(**settings)
        except Exception as e:  # noqa: BLE001 — any failure here must stop the program, not half-start it
            fail(e)
            return
        then()

    when_imported("torch", enable)
    return enable


def stop(message: str) -> None:
    """End the program with ``message`` and EXIT_BAD_SETTING, from anywhere (site.py's .pth lines,
    an import statement). os._exit: a SystemExit raised while site.py runs .pth lines would not stop
    every interpreter, and one raised by ``import torch`` could be caught by the program."""
    sys.stderr.write(message + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_BAD_SETTING)


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
                 format_bytes(s["allocated_bytes.peak"]), format_bytes(s["budget_bytes"]),
                 s.get("num_evictions", 0), s.get("num_rematerializations", 0), s.get("remat_seconds", 0.0))


def _summary_when_enabled() -> None:
    import atexit

    atexit.register(_summary_at_exit)


def activate(environ: Mapping[str, str] = os.environ) -> None:
    """Check the environment's settings now and enable pymem when the program imports torch, or stop
    the program with a clear message."""
    prefix = "pymem: cannot start from the environment: "
    try:
        settings = settings_from_env(environ)
    except ValueError as e:
        stop(prefix + str(e))
    level = settings.pop("log")
    if level:
        _configure_log(level)
    global from_environment
    from_environment = when_torch_imported(settings, fail=lambda e: stop(prefix + str(e)),
                                           then=_summary_when_enabled)


def cancel_environment() -> None:
    """``pymem run``: its flags replace the PYMEM_* variables' settings, not yet applied."""
    if from_environment is not None:
        cancel("torch", from_environment)


from_environment: Optional[Callable[[], None]] = None  # the environment's enable, while pending


if os.environ.get("PYMEM_BUDGET"):
    activate()
