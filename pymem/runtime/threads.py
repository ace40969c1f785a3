"""Every thread of the process under one runtime.

The interception is thread-local (interception.py: a dispatch key in the thread's included set, or
a mode on its stack): turning it on for the thread that calls ``enable()`` leaves the ops of every
other thread unseen, while the arena (the process's allocator) still caps their tensors. So while
the runtime is active, each thread that starts gets the interception for its whole run
(``threading.Thread._bootstrap_inner``, which every Thread, ThreadPoolExecutor worker included,
runs first). A thread that already existed cannot be reached from outside: its code can enter
``pymem.manage_thread()``; until then, an allocation of its that the pressure handler cannot make
room for fails with an error that names the thread. pymem's own workers (``pymem-*``: the prefetch
copier) stay outside: their copies are not ops.

Threads that ran an op through the interception (the autograd engine's, which inherit it with the
rest of the thread-local state) count as managed from their first op.
"""
import contextlib
import threading
from typing import Iterator, Set

from .. import _C
from ..errors import OutOfBudgetError

_OWN_PREFIX = "pymem-"


class ThreadCoverage:
    """Managed threads of one runtime, and the start-up hook that manages new ones."""

    def __init__(self, rt, interception) -> None:
        self.rt = rt
        self._interception = interception  # interception.py: how one thread's ops reach the runtime
        self.managed: Set[int] = set()
        self._original = None

    def _manage_current(self, ident: int) -> None:
        """The calling thread (``ident``) is managed; the C mark lets the fast path check it per op."""
        self.managed.add(ident)
        _C.mark_thread_managed(self.rt)

    def install(self) -> None:
        self._manage_current(threading.get_ident())
        original = threading.Thread._bootstrap_inner
        coverage = self

        def _bootstrap_inner(thread):
            if thread.name.startswith(_OWN_PREFIX) or not coverage.rt.active:
                return original(thread)
            with coverage.managing():
                return original(thread)

        self._original = original
        threading.Thread._bootstrap_inner = _bootstrap_inner

    def uninstall(self) -> None:
        if self._original is not None:
            threading.Thread._bootstrap_inner = self._original
            self._original = None

    @contextlib.contextmanager
    def managing(self) -> Iterator[None]:
        """The calling thread's ops go through the runtime for the block."""
        ident = threading.get_ident()
        if ident in self.managed and self._interception.on_this_thread():
            yield
            return
        self._manage_current(ident)
        with self._interception.cover_thread():
            yield

    def seen(self, ident: int) -> None:
        """The calling thread (``ident``) ran an op through the interception."""
        self._manage_current(ident)

    def check_current(self, request: int) -> None:
        """Called when the pressure handler could not make room: an unmanaged thread gets an error
        that says why, instead of the arena's "released nothing"."""
        ident = threading.get_ident()
        if ident in self.managed:
            return
        name = threading.current_thread().name
        raise OutOfBudgetError(
            f"pymem: thread {name!r} (ident {ident}) allocates {request} B under pymem's budget of "
            f"{self.rt.budget} B, but pymem does not manage that thread: it started before pymem.enable(), "
            f"so its tensors are not tracked and none of them can be released. Start the thread after "
            f"pymem.enable() (or set PYMEM_BUDGET), or run its work inside `with pymem.manage_thread():`.")
