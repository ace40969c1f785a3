"""The objects that exist when pymem is enabled (torch's modules, the program's model) are frozen
for Python's cyclic garbage collector while it runs (``gc.freeze``), and thawed at ``disable``.

Why: pymem's bookkeeping makes a few GC-tracked objects per op (records, recipes), which an
unmanaged program does not, so collections run during training; each full collection used to walk
the whole heap (~290k objects after ``import torch``). On bench/remat_bench.py's tree model that was
76 ms of a 532 ms step; frozen, 11 ms. Frozen objects are still freed by reference counting; only
a reference cycle among them waits for ``disable`` to be collected. A program that froze objects
itself (``gc.get_freeze_count() > 0``: a pre-fork server) or turned the collector off is left as
it is."""
import gc


class HeapFreeze:
    def __init__(self) -> None:
        self._froze = False

    def install(self) -> None:
        if gc.isenabled() and gc.get_freeze_count() == 0:
            gc.freeze()
            self._froze = True

    def uninstall(self) -> None:
        if self._froze:
            gc.unfreeze()
            self._froze = False
