"""A small, slow, obviously-correct Python model of the C++ arena, for property tests.

It mirrors the documented behaviour, not the implementation: best fit by (size, address) over a
plain list, placement at the low (costly) or high (cheap) end, coalescing, the small region with
fallback, and a brute-force window search over every (left, right) pair.
"""
from dataclasses import dataclass, field
from typing import List, Optional

ALIGN = 512
SMALL_CAP = 64 << 20


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class MBlock:
    addr: int
    size: int
    allocated: bool = False
    owner: int = 0
    cost: float = 0.0
    pinned: bool = False
    requested: int = 0


class MRegion:
    def __init__(self, base: int, size: int):
        self.blocks: List[MBlock] = [MBlock(base, size)]

    def allocate(self, rounded: int, cheap: bool) -> Optional[MBlock]:
        fits = [b for b in self.blocks if not b.allocated and b.size >= rounded]
        if not fits:
            return None
        fb = min(fits, key=lambda b: (b.size, b.addr))
        i = self.blocks.index(fb)
        if fb.size == rounded:
            fb.allocated = True
            return fb
        if not cheap:
            rest = MBlock(fb.addr + rounded, fb.size - rounded)
            fb.size = rounded
            fb.allocated = True
            self.blocks.insert(i + 1, rest)
            return fb
        new = MBlock(fb.addr + fb.size - rounded, rounded, allocated=True)
        fb.size -= rounded
        self.blocks.insert(i + 1, new)
        return new

    def free(self, b: MBlock) -> None:
        b.allocated, b.owner, b.cost, b.pinned, b.requested = False, 0, 0.0, False, 0
        merged: List[MBlock] = []
        for x in self.blocks:
            if merged and not merged[-1].allocated and not x.allocated:
                merged[-1].size += x.size
            else:
                merged.append(x)
        self.blocks = merged


def releasable(b: MBlock) -> bool:
    return not b.allocated or (b.owner != 0 and not b.pinned)


def brute_force_window(blocks: List[MBlock], need: int, mode: str):
    """(victim blocks, window bytes, cost) or None: least cost, then fewest bytes, then leftmost end."""
    if mode == "one_at_a_time":
        cands = [(b.cost, -b.size, b.addr, b) for b in blocks if b.allocated and releasable(b)]
        if not cands:
            return None
        b = min(cands, key=lambda t: t[:3])[3]
        return [b], b.size, b.cost
    best = None
    for r in range(len(blocks)):
        for l in range(r, -1, -1):
            if not releasable(blocks[l]):
                break
            win = blocks[l:r + 1]
            nbytes = sum(b.size for b in win)
            if nbytes >= need:
                cost = sum(b.cost for b in win if b.allocated)
                key = (cost, nbytes, r)
                if best is None or key < best[0]:
                    best = (key, [b for b in win if b.allocated], nbytes, cost)
                break  # longer windows ending at r cost at least as much, with more bytes
    return None if best is None else best[1:]


class OutOfBudget(Exception):
    pass


@dataclass
class ArenaModel:
    budget: int
    small_threshold: int = 16384
    mode: str = "window"
    base: int = 0
    stats: dict = field(default_factory=dict)

    def __post_init__(self):
        small = min(self.budget // 256, SMALL_CAP) & ~(ALIGN - 1)
        if self.small_threshold == 0 or small + ALIGN > self.budget:
            small = 0
        if small == 0:
            self.small_threshold = 0
        self.main = MRegion(self.base, self.budget - small)
        self.small = MRegion(self.base + self.budget - small, small) if small else None
        self.live = {}
        self.stats = dict(allocated=0, peak=0, allocs=0, frees=0, pressure_events=0, released=0, ooms=0)

    def blocks(self) -> List[MBlock]:
        return self.main.blocks + (self.small.blocks if self.small else [])

    def _try(self, rounded: int, cheap: bool) -> Optional[MBlock]:
        if rounded <= self.small_threshold:
            b = self.small.allocate(rounded, False)
            if b:
                return b
        return self.main.allocate(rounded, cheap)

    def allocate(self, n: int, cheap=False, owner=0, cost=0.0, pinned=False, handler=True) -> int:
        s = self.stats
        if n > self.budget:
            s["ooms"] += 1
            raise OutOfBudget
        rounded = align_up(n)
        pressured = False
        while True:
            b = self._try(rounded, cheap)
            if b:
                b.owner, b.cost, b.pinned, b.requested = owner, cost, pinned, n
                self.live[b.addr] = b
                s["allocs"] += 1
                s["allocated"] += rounded
                s["peak"] = max(s["peak"], s["allocated"])
                return b.addr
            if not pressured:
                pressured = True
                s["pressure_events"] += 1
            win = brute_force_window(self.main.blocks, rounded, self.mode) if handler else None
            if win is None:
                s["ooms"] += 1
                raise OutOfBudget
            for v in win[0]:  # the test's handler releases every victim
                self.free(v.addr, released=True)

    def free(self, addr: int, released=False) -> None:
        b = self.live.pop(addr)
        self.stats["frees"] += 1
        self.stats["released"] += released
        self.stats["allocated"] -= b.size
        (self.small if self.small and addr >= self.small.blocks[0].addr else self.main).free(b)
