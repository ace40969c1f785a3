"""Restore verification (``pymem.enable(..., verify=True)``, ``PYMEM_VERIFY=1``): each value pymem
releases is checksummed as it leaves memory, and checked as it comes back, recomputed or copied back
(on demand or prefetched). One that comes back different raises ``RestoreMismatchError`` there,
naming it: a break of bitwise equality made loud at its source, where it would otherwise surface
(if ever) as slightly different weights steps later. A value freed by its last tensor's death was
not released by pymem: nothing was taken, nothing is checked. Costs a CRC over each released value's
bytes twice (and, on CUDA, a copy to the host for each): a debugging aid, off by default."""
import ctypes
import weakref
import zlib

import torch

from .. import _C
from ..errors import RestoreMismatchError
from .interception import own_work


def checksum(sref, nbytes: int, device: torch.device) -> int:
    """CRC-32 of the first ``nbytes`` of ``sref``'s storage (a _C.StorageRef). On the CPU read in
    place: no op runs, no byte is copied, nothing is allocated in the arena."""
    if device.type == "cpu":
        return zlib.crc32((ctypes.c_char * nbytes).from_address(sref.data_ptr))
    with own_work():
        host = sref.view(torch.uint8, [nbytes], [1], 0).cpu()
    return zlib.crc32(host.numpy().tobytes())


class RestoreCheck:
    """The checksums of the values released and not yet back, by record (weakly: a value no one
    needs any more takes its checksum with it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # record -> CRC when released
        self.num_verified = 0

    def left(self, r, sref) -> None:
        """``r`` is released now; ``sref`` holds its value (its storage, or its cache entry)."""
        if sref is not None and sref.alive and sref.data_ptr:
            self.sums[r] = checksum(sref, r.nbytes, self.device)

    def back(self, r, tensor: torch.Tensor, how: str) -> None:
        """``r``'s value is in ``tensor``'s storage, about to be adopted; raises if it differs."""
        want = self.sums.pop(r, None)
        if want is None:
            return
        ref = _C.StorageRef(tensor)
        if ref.nbytes < r.nbytes:
            return  # bring_back says what is wrong with a buffer of another size
        got = checksum(ref, r.nbytes, self.device)
        self.num_verified += 1
        if got != want:
            err = RestoreMismatchError(
                f"pymem: {how} of {r.op} ({r.nbytes} B) gave other bytes than it held when released "
                f"(CRC-32 {want:#010x} then, {got:#010x} now): the program would have gone on with a wrong "
                f"value. Either a write pymem could not see (through a raw pointer it was not told of: see "
                f"pymem.pin) changed what the value is made from, or pymem has a bug: please report it.")
            err.op, err.nbytes, err.how = r.op, r.nbytes, how
            raise err
