"""Bad input: a clear Python exception, never corruption; the arena stays usable afterwards."""
import pytest

from arena_module import C, OutOfBudget


@pytest.fixture
def arena():
    return C.Arena(1 << 20, backing="virtual")


def test_size_zero(arena):
    with pytest.raises(ValueError, match="allocation size must be a positive number of bytes, got 0"):
        arena.allocate(0)


def test_negative_size(arena):
    with pytest.raises(ValueError, match="got -4096"):
        arena.allocate(-4096)


def test_size_above_budget(arena):
    with pytest.raises(OutOfBudget) as e:
        arena.allocate((1 << 20) + 1)
    msg = str(e.value)
    assert "cannot allocate 1048577 bytes" in msg and "budget of 1048576 bytes" in msg
    assert "larger than the whole budget" in msg


def test_budget_below_alignment():
    with pytest.raises(ValueError, match=r"budget must be at least 512 bytes \(the arena's alignment\), got 100"):
        C.Arena(100)
    with pytest.raises(ValueError, match="budget must be a multiple of 512 bytes, got 1000"):
        C.Arena(1000)
    with pytest.raises(ValueError, match="budget must be a positive number of bytes, got -1"):
        C.Arena(-1)


def test_bad_backing_and_search():
    with pytest.raises(ValueError, match="backing must be 'host' or 'virtual'"):
        C.Arena(1 << 20, backing="gpu")
    with pytest.raises(ValueError, match="search must be 'window', 'one_at_a_time' or 'handler', got 'best'"):
        C.Arena(1 << 20, search="best")


def test_free_foreign_pointer(arena):
    with pytest.raises(ValueError, match="0x1234 was not allocated by this arena"):
        arena.free(0x1234)


def test_double_free(arena):
    a = arena.allocate(4096)
    arena.free(a)
    with pytest.raises(ValueError, match="is inside this arena but is not the start of an allocated block"):
        arena.free(a)
    assert arena.stats()["num_frees"] == 1


def test_pointer_into_a_block(arena):
    a = arena.allocate(8192)
    with pytest.raises(ValueError, match="not the start of an allocated block"):
        arena.free(a + 512)
    arena.free(a)  # the block itself is intact


def test_negative_or_nan_cost(arena):
    a = arena.allocate(4096, owner=1)
    with pytest.raises(ValueError, match="release cost must be a finite number >= 0"):
        arena.set_cost(a, -1.0)
    with pytest.raises(ValueError, match="release cost must be a finite number >= 0"):
        arena.set_owner(a, 1, float("nan"))
    with pytest.raises(ValueError, match="release cost must be a finite number >= 0"):
        arena.allocate(4096, cost=float("inf"))


def test_handler_that_releases_nothing(arena):
    a = arena.allocate(900_000, owner=7, cost=1.0)
    calls = []
    arena.set_pressure_handler(lambda request, window: calls.append(window.owners))
    with pytest.raises(OutOfBudget, match="the pressure handler released nothing"):
        arena.allocate(500_000)
    assert calls == [[7]]
    arena.free(a)
    arena.allocate(500_000)  # usable afterwards


def test_handler_exception_propagates_and_arena_stays_valid(arena):
    a = arena.allocate(900_000, owner=7, cost=1.0)

    def boom(request, window):
        raise KeyError("from the handler")

    arena.set_pressure_handler(boom)
    with pytest.raises(KeyError, match="from the handler"):
        arena.allocate(500_000)
    arena.set_pressure_handler(None)
    arena.free(a)
    assert arena.stats()["allocated_bytes.current"] == 0
    assert arena.allocate(500_000) == arena.base


def test_out_of_budget_message_and_attributes(arena):
    arena.allocate(600_000, pinned=True, owner=1)
    arena.set_pressure_handler(lambda r, w: None)
    with pytest.raises(OutOfBudget) as e:
        arena.allocate(600_000)
    err = e.value
    assert "no releasable window covers the request" in str(err)
    assert err.requested == 600_000 and err.budget == 1 << 20
    assert err.pinned_bytes == 600_064 and err.largest_free_block < 600_000


def test_handler_must_be_callable(arena):
    with pytest.raises(TypeError, match="pressure handler must be callable"):
        arena.set_pressure_handler(42)


def test_window_size_checked(arena):
    with pytest.raises(ValueError, match="window size must be a positive number of bytes, got 0"):
        arena.find_window(0)
