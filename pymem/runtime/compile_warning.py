"""torch.compile under pymem: a compiled region runs eagerly, op by op, through pymem's interception
(torch.compile does not trace while a TorchDispatchMode is active, and falls back to the original
Python code; pymem's dispatcher interception counts as one: a compiled kernel that fills buffers no
op pymem sees would leave recipes that recompute wrong values). Results are the eager module's, not
the compiled kernels'. Dynamo does that silently; pymem says so, once per process, the first time
Dynamo skips a frame for it.

Importing Dynamo costs over a second, so a program that never compiles never pays for it: the
patches wait for Dynamo's own import (``pymem.import_hook``) and go in right after it, before any
frame can be compiled."""
import sys
import warnings

from ..import_hook import when_imported

_MESSAGE = ("pymem: torch.compile runs compiled code eagerly while pymem is enabled (torch.compile does not "
            "compile while pymem intercepts every op, as under a TorchDispatchMode): its results are those "
            "of the uncompiled code, its tensors are managed like any other. See README, 'Works with'.")
_warned = False
_DYNAMO = "torch._dynamo.convert_frame"
_waiting = None  # the CompileWarning whose install waits for Dynamo's import (one hook a process)
_hooked = False


def _dispatch_mode_skip(reason) -> bool:
    return isinstance(reason, str) and "dispatch mode" in reason


class CompileWarning:
    """Wraps Dynamo's skip handler while the runtime is active (install / uninstall); a no-op where
    Dynamo is not importable or no longer has that handler."""

    def __init__(self) -> None:
        self._cls = self._original = None
        self._mode_checks = {}  # convert_frame's dispatch-mode predicates we wrapped: name -> original
        self._pending = None    # install's arguments while Dynamo is not imported yet

    def install(self, own_code=(), intercepting=None) -> None:
        """``own_code``: code objects of pymem's that Dynamo must never trace (the mode's dispatch
        frame: its callback would fire on entering it, before the frame can turn it off).
        ``intercepting``: () -> True while this thread's ops reach pymem outside any mode (the
        dispatcher interception): Dynamo then skips frames as it does under a mode."""
        global _waiting, _hooked
        if _DYNAMO not in sys.modules:
            _waiting, self._pending = self, (tuple(own_code), intercepting)
            if not _hooked:
                _hooked = True
                when_imported(_DYNAMO, _install_waiting)
            return
        self._patch(own_code, intercepting)

    def _patch(self, own_code, intercepting) -> None:
        try:
            from torch._dynamo import convert_frame
            from torch._dynamo.convert_frame import CatchErrorsWrapper
            from torch._dynamo.eval_frame import skip_code
        except Exception:  # noqa: BLE001  (no Dynamo in this build: nothing can be compiled)
            return
        for code in own_code:
            skip_code(code)
        if intercepting is not None:
            for name in ("any_torch_dispatch_mode_on_stack", "is_in_any_mode_without_ignore_compile_internals"):
                check = getattr(convert_frame, name, None)
                if check is not None:
                    self._mode_checks[name] = check
                    setattr(convert_frame, name, self._or_intercepting(check, intercepting))
        original = CatchErrorsWrapper.__dict__.get("_handle_skip")
        if original is None:
            return

        def _handle_skip(self, result, frame):
            global _warned
            if not _warned and _dispatch_mode_skip(getattr(result, "skip_reason", None)):
                _warned = True
                warnings.warn(_MESSAGE, RuntimeWarning, stacklevel=2)
            return original(self, result, frame)

        self._cls, self._original = CatchErrorsWrapper, original
        CatchErrorsWrapper._handle_skip = _handle_skip

    @staticmethod
    def _or_intercepting(check, intercepting):
        def mode_present(*args, **kwargs):
            return intercepting() or check(*args, **kwargs)
        return mode_present

    def uninstall(self) -> None:
        global _waiting
        if _waiting is self:
            _waiting, self._pending = None, None
        if self._mode_checks:
            from torch._dynamo import convert_frame
            for name, check in self._mode_checks.items():
                setattr(convert_frame, name, check)
            self._mode_checks = {}
        if self._cls is not None:
            self._cls._handle_skip = self._original
            self._cls = self._original = None


def _install_waiting() -> None:
    """Right after Dynamo's import: the patches of the runtime active now, if any."""
    global _hooked, _waiting
    _hooked = False
    cw, _waiting = _waiting, None
    if cw is not None and cw._pending is not None:
        own_code, intercepting = cw._pending
        cw._pending = None
        cw._patch(own_code, intercepting)
