"""torch.compile under pymem: a compiled region runs eagerly, op by op, through pymem's dispatch
mode (torch.compile does not trace while a TorchDispatchMode is active, and falls back to the
original Python code). Results are the eager module's, not the compiled kernels'. Dynamo does
that silently; pymem says so, once per process, the first time Dynamo skips a frame for it."""
import warnings

_MESSAGE = ("pymem: torch.compile runs compiled code eagerly while pymem is enabled (torch.compile does not "
            "compile under a TorchDispatchMode, which is how pymem sees every op): its results are those "
            "of the uncompiled code, its tensors are managed like any other. See README, 'Works with'.")
_warned = False


def _dispatch_mode_skip(reason) -> bool:
    return isinstance(reason, str) and "dispatch mode" in reason


class CompileWarning:
    """Wraps Dynamo's skip handler while the runtime is active (install / uninstall); a no-op where
    Dynamo is not importable or no longer has that handler."""

    def __init__(self) -> None:
        self._cls = self._original = None

    def install(self, own_code=()) -> None:
        """``own_code``: code objects of pymem's that Dynamo must never trace (the mode's dispatch
        frame: its callback would fire on entering it, before the frame can turn it off)."""
        try:
            from torch._dynamo.convert_frame import CatchErrorsWrapper
            from torch._dynamo.eval_frame import skip_code
        except Exception:  # noqa: BLE001  (no Dynamo in this build: nothing can be compiled)
            return
        for code in own_code:
            skip_code(code)
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

    def uninstall(self) -> None:
        if self._cls is not None:
            self._cls._handle_skip = self._original
            self._cls = self._original = None
