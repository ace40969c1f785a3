"""A tensor's bytes reached without an aten op: read ones are restored first, shared ones pinned.

Reads. ``t.tolist()``, ``copy.deepcopy(t)``, pickling and ``torch.save`` reach the
storage directly, so the dispatch mode never sees them and an evicted value (an empty storage)
would be read as nothing. While the runtime is active these methods are wrapped: an evicted or
offloaded value is brought back before the original method runs. ``torch.save`` pickles every
tensor first and writes their bytes afterwards, and bringing one back may release another, so
within a save every value it pickles stays held (unreleasable) until the save returns.

Exports. ``t.numpy()`` (and ``np.asarray(t)`` through ``__array__``), ``t.__dlpack__()``,
``t.__cuda_array_interface__``,
``torch.utils.dlpack.to_dlpack``, ``t.share_memory_()``, ``t.data_ptr()`` and a ``from_dlpack``
whose tensor lies on memory pymem manages hand the storage's address to someone pymem cannot
follow. The storage is brought back if released, then pinned (``Runtime.pin``: never released,
moved by compaction or offloaded): until the NumPy array (and every view of it) dies, where that
can be observed, else for the storage's life.

``data_ptr()`` pins once per storage (``Record.address_out``), not once per call: libraries call it
to compare addresses (weight tying, cuDNN's flat weights), and a count per call would never come
back to zero. Its pin is for the storage's life, since a C extension may keep the address;
``pymem.unpin(t)`` takes it back (code that only compared), and the next ``data_ptr()`` pins again.
A call from torch's own Python code does not pin: torch compares addresses there
(``allow_mutation_on_saved_tensors`` on every saved tensor, RNN weight checks) or hands them out
through a path pinned on its own (``__cuda_array_interface__``); pinning every saved activation
would leave nothing to release.

Storage resizes. ``UntypedStorage.resize_`` (FSDP frees and regrows parameters with it) destroys the
value a storage holds without an op: the runtime is told first (``Runtime.before_resize``).

Not covered: an address taken inside C++ (an extension's ``tensor.data_ptr()`` on its side of the
binding): ``pymem.pin(t)`` is for that.
"""
import contextlib
import sys
import weakref
from typing import Callable, Dict, List, Optional

import torch
import torch.utils.dlpack

from .. import _C

_Tensor = torch.Tensor
_storage_key = _C.storage_key
# Methods of torch.Tensor (or its C base) that read the storage's bytes without an aten op.
_READERS = ("tolist", "__deepcopy__", "__reduce_ex__")
# Methods that hand the storage's address out: pinned (reason, whether the result's death unpins).
_EXPORTERS = {"numpy": ("numpy", True), "__dlpack__": ("dlpack", False), "share_memory_": ("shared memory", False)}
_MISSING = object()


class RawAccess:
    """The wrapped methods of one active runtime (install / uninstall)."""

    def __init__(self, rt) -> None:
        self.rt = rt
        self._saved: Dict[str, object] = {}
        self._patched: List[tuple] = []   # (object, attribute, original) outside torch.Tensor
        self._held: Optional[List] = None  # records held by the torch.save in progress

    # ------------------------------------------------------------------ what the wrappers do
    def make_readable(self, t) -> None:
        """Brings ``t``'s value back if the runtime released it; inside a save, holds it."""
        rt = self.rt
        key = _storage_key(t) if isinstance(t, _Tensor) else 0
        if not key:
            return
        with rt.lock:
            r = rt.table.get(key)
            if r is None:
                return
            if r.evicted:
                rt.restore_for_read(r)
            if self._held is not None:
                r.locks += 1
                self._held.append(r)

    def hand_out_address(self, t) -> None:
        """``data_ptr()``: brought back, then pinned for the storage's life unless already pinned so."""
        self.make_readable(t)
        if isinstance(t, _Tensor):
            self.rt.pin_address(t)

    def export(self, t, reason: str, result=None) -> None:
        """``t``'s storage leaves torch's sight: pinned until ``result`` dies (when given and
        weakly referable), else for the storage's life."""
        if not isinstance(t, _Tensor):
            return
        rt = self.rt
        if rt.pin(t, reason) is None or result is None:
            return
        try:
            weakref.finalize(result, rt.unpin_key, _storage_key(t))
        except TypeError:  # no weak references to it: the pin stays with the storage
            pass

    def foreign(self, t, reason: str) -> None:
        """``t`` (a new storage) lies on memory pymem manages under another storage: pin the owner."""
        if isinstance(t, _Tensor) and t.device.type == self.rt.device.type:
            self.rt.pin_owner_of(t.untyped_storage().data_ptr(), reason)

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

    # ------------------------------------------------------------------ installing the wrappers
    def install(self) -> None:
        for name in _READERS:
            self._wrap_method(name, self._reader(getattr(_Tensor, name)))
        self._wrap_method("data_ptr", self._address(_Tensor.data_ptr))
        for name, (reason, unpins) in _EXPORTERS.items():
            self._wrap_method(name, self._exporter(getattr(_Tensor, name), reason, unpins))
        interface = _Tensor.__dict__.get("__cuda_array_interface__")  # CuPy, Numba: a property
        if isinstance(interface, property):
            self._wrap_method("__cuda_array_interface__",
                              property(self._exporter(interface.fget, "cuda array interface", False)))
        for module in (torch, torch.serialization):
            self._patch(module, "save", self._saver(module.save))
        to_dlpack = self._exporter(torch.utils.dlpack.to_dlpack, "dlpack", False)
        for module in (torch, torch.utils.dlpack):
            if hasattr(module, "to_dlpack"):
                self._patch(module, "to_dlpack", to_dlpack)
        # UntypedStorage.resize_ is no aten op (FSDP frees and regrows its unsharded parameters with
        # it): the runtime must see the value it destroys.
        self._patch(torch.UntypedStorage, "resize_", self._resizer(torch.UntypedStorage.resize_))
        # torch.utils.dlpack.from_dlpack looks this up at each call, so it covers every consumer,
        # including a capsule made by a to_dlpack imported before pymem was enabled.
        self._patch(torch._C, "_from_dlpack", self._consumer(torch._C._from_dlpack, "dlpack"))

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            if original is _MISSING:
                delattr(_Tensor, name)  # defined on the C base class: unshadow it
            else:
                setattr(_Tensor, name, original)
        self._saved.clear()
        for obj, name, original in reversed(self._patched):
            setattr(obj, name, original)
        self._patched.clear()

    def _wrap_method(self, name: str, wrapper) -> None:
        self._saved[name] = _Tensor.__dict__.get(name, _MISSING)
        setattr(_Tensor, name, wrapper)

    def _patch(self, obj, name: str, wrapper) -> None:
        self._patched.append((obj, name, getattr(obj, name)))
        setattr(obj, name, wrapper)

    def _reader(self, original):
        make_readable = self.make_readable

        def read(self_tensor, *args, **kwargs):
            make_readable(self_tensor)
            return original(self_tensor, *args, **kwargs)

        return _named(read, original)

    def _address(self, original):
        hand_out_address, make_readable = self.hand_out_address, self.make_readable

        def data_ptr(t):
            if _from_torch(sys._getframe(1)):
                make_readable(t)
            else:
                hand_out_address(t)
            return original(t)

        return _named(data_ptr, original)

    def _exporter(self, original, reason: str, unpins: bool):
        make_readable, export = self.make_readable, self.export

        def hand_out(t, *args, **kwargs):
            make_readable(t)
            out = original(t, *args, **kwargs)
            export(t, reason, out if unpins else None)
            return out

        return _named(hand_out, original)

    def _consumer(self, original, reason: str):
        foreign = self.foreign

        def take_in(*args, **kwargs):
            out = original(*args, **kwargs)
            foreign(out, reason)
            return out

        return _named(take_in, original)

    def _resizer(self, original):
        before_resize = self.rt.before_resize

        def resize_(storage, nbytes):
            before_resize(storage, nbytes)
            return original(storage, nbytes)

        return _named(resize_, original)

    def _saver(self, original):
        saving = self.saving

        def save(*args, **kwargs):
            with saving():
                return original(*args, **kwargs)

        return _named(save, original)


def _from_torch(frame) -> bool:
    """The calling frame is torch's own Python code."""
    name = frame.f_globals.get("__name__", "")
    return name == "torch" or name.startswith("torch.")


def _named(wrapper, original) -> Callable:
    wrapper.__name__ = getattr(original, "__name__", wrapper.__name__)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original
    return wrapper
