"""compaction_plan's pricing of the pressure handler's two ways when the free bytes cover a request
only scattered: compacting (bytes_to_move) against releasing until it fits (release_path_seconds)."""
import math
from collections import namedtuple

from pymem import compaction_plan

Block = namedtuple("Block", "addr size allocated region")
Value = namedtuple("Value", "next_use has_host_copy swap_cost compute_cost evicted_ancestor_cost")


def layout(*sizes_and_states):
    """Main-region blocks from (size, allocated) in address order."""
    blocks, addr = [], 0
    for size, allocated in sizes_and_states:
        blocks.append(Block(addr, size, allocated, "main"))
        addr += size
    return blocks


def test_releasing_stops_where_the_request_fits_beside_a_hole():
    blocks = layout((1, True), (1, False), (1, True), (1, False), (1, True))  # A . B . C
    order = [(4, "c"), (0, "a")]
    cost = {"a": 1.0, "b": 4.0, "c": 2.0}.__getitem__
    assert compaction_plan.release_path_seconds(blocks, 2, order, cost) == 2.0  # C and the hole below it
    # Three contiguous bytes: A and its hole are two, B joins both holes.
    assert compaction_plan.release_path_seconds(blocks, 3, [(0, "a"), (2, "b")], cost) == 5.0


def test_releases_that_add_up_to_the_request_without_fitting_leave_it_to_compaction():
    blocks = layout((2, True), (1, True), (2, True), (1, False))  # A B C .
    order = [(0, "a"), (3, "c")]
    assert compaction_plan.release_path_seconds(blocks, 4, order, lambda v: 1.0) is None
    # Another region's blocks are not the main region's holes.
    small = blocks + [Block(6, 8, False, "small")]
    assert compaction_plan.release_path_seconds(small, 4, order, lambda v: 1.0) is None


def test_a_comeback_costs_nothing_where_the_plan_reads_the_value_no_more():
    gone = Value(math.inf, False, 5.0, 3.0, 4.0)
    assert compaction_plan.comeback_seconds(gone) == 0.0
    assert compaction_plan.comeback_seconds(gone._replace(next_use=0.5)) == 7.0  # recompute + evicted ancestors
    assert compaction_plan.comeback_seconds(gone._replace(next_use=None, has_host_copy=True)) == 5.0  # copy back


def test_releases_that_add_up_to_the_request_are_priced_with_the_compaction_after_them():
    """The handler, having released A and C, slides B (1 byte) to fit 4: that move is part of the
    release path's price. Where B may not move, no compaction fits it by moves alone: inf."""
    blocks = layout((2, True), (1, True), (2, True), (1, False))  # A B C .
    order = [(0, "a"), (3, "c")]
    movable = {0: ("a", None, True), 2: ("b", None, False), 3: ("c", None, True)}
    assert compaction_plan.bytes_to_move_after(blocks, {0, 3}, 4, movable) == 1
    assert compaction_plan.bytes_to_move_after(blocks, {0, 3}, 4, {0: movable[0], 3: movable[3]}) is None

    def then(freed):
        moved = compaction_plan.bytes_to_move_after(blocks, freed, 4, movable)
        return math.inf if moved is None else 10.0 * moved
    assert compaction_plan.release_path_seconds(blocks, 4, order, lambda v: 1.0, then) == 12.0
    # Releases that never reach the request: compaction is the only way (None).
    assert compaction_plan.release_path_seconds(blocks, 6, order, lambda v: 1.0, then) is None
