"""The objects that exist when pymem is enabled (torch's modules, the program's model) are frozen
for Python's cyclic garbage collector while it runs (``gc.freeze``), and thawed at ``disable``.

Why: pymem's bookkeeping makes a few GC-tracked objects per op (records, recipes), which an
unmanaged program does not, so collections run during training; each full collection used to walk
the whole heap (~290k objects after ``import torch``). On bench/remat_bench.py's tree model that was
76 ms of a 532 ms step; frozen, 11 ms. Frozen objects are still freed by reference counting; only
a reference cycle among them waits for ``disable`` to be collected. A program that froze objects
itself (``gc.get_freeze_count() > 0``: a pre-fork server) or turned the collector off is left as
it is; one that freezes more while pymem runs keeps its freeze (``disable`` then thaws nothing)."""
import gc


class HeapFreeze:
    def __init__(self) -> None:
        self._froze = False
        self._program_froze = False
        self._original = None

    def install(self) -> None:
        if not gc.isenabled() or gc.get_freeze_count() != 0:
            return
        gc.freeze()
        self._froze, self._program_froze = True, False
        original = self._original = gc.freeze

        def freeze():  # the program freezes too (before a fork): disable must not thaw its objects
            self._program_froze = True
            original()

        freeze.__doc__ = original.__doc__
        gc.freeze = freeze

    def uninstall(self) -> None:
        if self._original is not None:
            gc.freeze = self._original
            self._original = None
        if self._froze and not self._program_froze:
            gc.unfreeze()
        self._froze = False
