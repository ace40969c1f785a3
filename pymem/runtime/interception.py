"""How the runtime sees every aten op: the dispatcher (C++) or a Python TorchDispatchMode.

``dispatcher`` (the default where this torch takes the fallback): pymem's boxed fallback on
DispatchKey::Fake (``csrc/intercept.cpp``), included in each managed thread's dispatch keys. Common
ops are booked in C++ (``csrc/fast_op.cpp``, about 3x less per op than the mode); the rest reach
``run_op`` as a mode's would. No mode is active under it, so ATen's isTensorSubclassLike() stays
false and kernels take the path they take unmanaged (under any mode, masked_fill's and prod's
gradients round differently: tests/test_opinfo.py).
``mode`` (``PYMEM_INTERCEPT=mode``, and where torch refuses the fallback: a torch that owns
DispatchKey::Fake): a TorchDispatchMode per thread; every op goes through ``Runtime.run_op``.
Both see the same ops: the forward's, and the backward formulas' on the autograd engine's threads
(they inherit the thread's dispatch state, mode stack and keys alike); neither sees the ops a kernel
runs inside itself. Asking for the dispatcher where torch refuses it is an error that says so.
"""
import contextlib
import functools
import threading
from typing import Iterator

from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes,
                                         _get_current_dispatch_mode_stack)

from .. import _C

_get_ident = threading.get_ident
try:  # what torch._disable_dynamo does around a call, without its wrapper's cost (see _Mode)
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
    _OWN_DYNAMO_GUARD = True
except ImportError:  # no Dynamo in this build: torch's own wrapper (if any) stays
    _OWN_DYNAMO_GUARD = False

    def _set_eval_frame(callback):
        return None

NAMES = ("dispatcher", "mode")


def _run(rt, func, args, kwargs):
    """One op through the runtime: what both interceptions do with an op they hand to Python."""
    if not rt.active:
        return func(*args, **(kwargs or {}))
    ident = _get_ident()
    if ident not in rt.threads.managed:  # the autograd engine's threads inherit the interception
        rt.threads.seen(ident)
    # The interception is off inside its own dispatch, so a torch.compile'd caller's frame callback
    # would try to trace pymem's frames: no callback while they run.
    prior = _set_eval_frame(None)
    try:
        with rt.lock:
            return rt.run_op(func, args, kwargs)
    finally:
        _set_eval_frame(prior)


class _Mode(TorchDispatchMode):
    """One per thread (a mode's enter/exit state is per instance). After ``disable`` a thread that
    still has it passes ops straight through."""

    def __init__(self, rt) -> None:
        super().__init__()
        self.rt = rt

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch would wrap __torch_dispatch__ in torch._disable_dynamo, ~3.5 us per op; it
        keeps Dynamo out of pymem's own frames itself, at a fraction of that (_run)."""
        return not _OWN_DYNAMO_GUARD

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(self.rt, func, args, kwargs)


class ModeInterception:
    name = "mode"
    own_code = (_Mode.__torch_dispatch__.__code__, _run.__code__)
    outside_modes = None  # Dynamo sees the mode itself

    def __init__(self, rt) -> None:
        self.rt = rt
        self.mode = None

    def start(self) -> None:
        self.mode = _Mode(self.rt)
        self.mode.__enter__()

    def stop(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None

    @contextlib.contextmanager
    def cover_thread(self) -> Iterator[None]:
        with _Mode(self.rt):
            yield

    def on_this_thread(self) -> bool:
        return any(isinstance(m, _Mode) and m.rt is self.rt for m in _get_current_dispatch_mode_stack())


class DispatcherInterception:
    name = "dispatcher"
    own_code = (_run.__code__,)
    outside_modes = staticmethod(_C.interception_included)  # what Dynamo must count as a mode

    def __init__(self, rt) -> None:
        self.rt = rt
        self._prior = False

    def start(self) -> None:
        why = _C.install_interception()
        if why:
            raise RuntimeError(f"pymem: cannot register its dispatcher fallback on DispatchKey::Fake: {why}")
        rt = self.rt
        _C.set_interception_handler(functools.partial(_run, rt), str(rt.device))
        _C.set_fast_path(rt)
        self._prior = _C.set_interception_included(True)

    def stop(self) -> None:
        _C.set_interception_included(self._prior)
        _C.set_fast_path(None)
        _C.set_interception_handler(None, "cpu")  # other threads' ops pass straight through now

    @contextlib.contextmanager
    def cover_thread(self) -> Iterator[None]:
        prior = _C.set_interception_included(True)
        try:
            yield
        finally:
            _C.set_interception_included(prior)

    def on_this_thread(self) -> bool:
        return _C.interception_included()


def make(name: str, rt):
    return DispatcherInterception(rt) if name == "dispatcher" else ModeInterception(rt)


@contextlib.contextmanager
def own_work() -> Iterator[None]:
    """pymem's own ops (a recompute for a raw read, an offload's copy): seen by no interception."""
    prior = _C.set_interception_excluded(True)
    try:
        with _disable_current_modes():
            yield
    finally:
        _C.set_interception_excluded(prior)
