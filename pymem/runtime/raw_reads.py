"""Reads of a tensor's bytes that no aten op carries: the value is made resident first.

``t.tolist()``, ``t.numpy()`` (and ``np.asarray(t)`` through ``__array__``), ``t.data_ptr()``,
``t.__dlpack__()``, ``copy.deepcopy(t)``, pickling and ``torch.save`` reach the storage directly,
so the dispatch mode never sees them and an evicted value (an empty storage) would be read as
nothing. While the runtime is active these methods are wrapped: an evicted or offloaded value is
brought back before the original method runs. ``torch.save`` pickles every tensor first and writes
their bytes afterwards, and bringing one back may release another, so within a save every value it
pickles stays held (unreleasable) until the save returns.

Not covered here: a NumPy array or pointer kept after the call (compaction or a later release may
move or free the bytes under it).
"""
import contextlib
from typing import Callable, Dict, List, Optional

import torch

from .. import _C

_Tensor = torch.Tensor
_storage_key = _C.storage_key
# Methods of torch.Tensor (or its C base) that read the storage's bytes without an aten op.
_READERS = ("tolist", "numpy", "data_ptr", "__dlpack__", "__deepcopy__", "__reduce_ex__")
_MISSING = object()


class RawReads:
    """The wrapped methods of one active runtime (install / uninstall)."""

    def __init__(self, rt) -> None:
        self.rt = rt
        self._saved: Dict[str, object] = {}
        self._save_fns: Dict[str, Callable] = {}
        self._held: Optional[List] = None  # records held by the torch.save in progress

    def make_readable(self, t) -> None:
        """Brings ``t``'s value back if the runtime released it; inside a save, holds it."""
        rt = self.rt
        key = _storage_key(t) if isinstance(t, _Tensor) else 0
        r = rt.table.get(key) if key else None
        if r is None:
            return
        if r.evicted:
            rt.restore_for_read(r)
        if self._held is not None:
            r.locks += 1
            self._held.append(r)

    @contextlib.contextmanager
    def saving(self):
        """torch.save: values it pickles stay resident until their bytes are written."""
        outer = self._held is None
        if outer:
            self._held = []
        try:
            yield
        finally:
            if outer:
                for r in self._held:
                    r.locks -= 1
                self._held = None

    def install(self) -> None:
        for name in _READERS:
            original = getattr(_Tensor, name)
            self._saved[name] = _Tensor.__dict__.get(name, _MISSING)
            setattr(_Tensor, name, self._reader(original))
        for module in (torch, torch.serialization):
            original = module.save
            self._save_fns[module.__name__] = original
            module.save = self._saver(original)

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            if original is _MISSING:
                delattr(_Tensor, name)  # defined on the C base class: unshadow it
            else:
                setattr(_Tensor, name, original)
        self._saved.clear()
        for module in (torch, torch.serialization):
            if module.__name__ in self._save_fns:
                module.save = self._save_fns.pop(module.__name__)

    def _reader(self, original):
        make_readable = self.make_readable

        def read(self_tensor, *args, **kwargs):
            make_readable(self_tensor)
            return original(self_tensor, *args, **kwargs)

        read.__name__ = getattr(original, "__name__", "read")
        read.__doc__ = getattr(original, "__doc__", None)
        read.__wrapped__ = original
        return read

    def _saver(self, original):
        saving = self.saving

        def save(*args, **kwargs):
            with saving():
                return original(*args, **kwargs)

        save.__name__, save.__doc__, save.__wrapped__ = "save", original.__doc__, original
        return save
