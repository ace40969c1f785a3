"""The user-facing API: budget forms, enable twice, budget scopes, summary, logging."""
import logging

import pytest
import torch

import pymem
from pymem.budget import parse_budget


@pytest.mark.parametrize("text,expect", [
    ("20GB", 20 * 1000 ** 3), ("20GiB", 20 * 1024 ** 3), ("512MB", 512 * 1000 ** 2), ("1.5TB", 1_500_000_000_000),
    ("64kB", 64_000 // 512 * 512), ("3 MiB", 3 << 20), ("4096", 4096), ("4096B", 4096), (1 << 20, 1 << 20),
    ("1000", 512),  # rounded down to the arena's granularity: the budget never grows
])
def test_budget_forms(text, expect):
    assert parse_budget(text) == expect


def test_percent_of_the_device_memory():
    assert parse_budget("80%", total=10_000_000) == 8_000_000 // 512 * 512
    assert parse_budget("100%", total=1 << 30) == 1 << 30
    assert 0 < parse_budget("1%") < parse_budget("2%")  # this machine's memory


@pytest.mark.parametrize("bad", ["20XB", "-5GB", "", "GB", "1e9", "20 G B", "1.2.3GB", 1.5, True, None, [1]])
def test_bad_budgets_quote_the_value_and_list_the_accepted_forms(bad):
    with pytest.raises(ValueError) as e:
        parse_budget(bad)
    msg = str(e.value)
    assert f"budget {bad!r} is not accepted" in msg
    assert '"20GB", "20GiB", "512MB", "1.5TB"' in msg and '"80%"' in msg and "KiB" in msg


@pytest.mark.parametrize("bad,why", [(0, "below the arena's granularity"), ("100B", "below the arena's granularity"),
                                     ("0%", "a percentage must be in"), ("150%", "a percentage must be in")])
def test_budgets_out_of_range(bad, why):
    with pytest.raises(ValueError, match=why):
        parse_budget(bad)


def test_budget_scope_restores_plain_pytorch():
    x = torch.ones(1000)
    with pymem.budget("4MiB") as rt:
        assert pymem.is_enabled() and rt.budget == 4 << 20
        y = x * 2
        pymem.evict(y)
        assert pymem.is_evicted(y)
    assert not pymem.is_enabled()
    assert torch.equal(y, torch.full((1000,), 2.0))  # restored on the way out
    assert pymem.memory_stats()["budget_bytes"] == 4 << 20  # the last run's stats stay readable


def test_budget_scope_inside_enable_is_an_error():
    pymem.enable("4MiB")
    try:
        with pytest.raises(RuntimeError, match="cannot be used while pymem is already enabled"):
            with pymem.budget("4MiB"):
                pass
        assert pymem.is_enabled()
    finally:
        pymem.disable()


def test_stats_and_summary_after_a_small_run():
    with pymem.budget("3MiB"):
        pymem.reset_peak_memory_stats()
        w = torch.randn(128, 128, requires_grad=True)
        x = torch.randn(512, 128)
        for _ in range(12):  # 12 saved 256 KiB activations and more do not fit in 3 MiB
            x = torch.tanh(x @ w)
        x.sum().backward()
        s = pymem.memory_stats()
        summary = pymem.memory_summary()
    for key in ("allocated_bytes.current", "allocated_bytes.peak", "budget_bytes", "num_evictions",
                "num_rematerializations", "remat_seconds", "num_compactions", "moved_bytes",
                "fragmentation.largest_free"):
        assert key in s
    assert s["budget_bytes"] == 3 << 20 and 0 < s["allocated_bytes.peak"] <= s["budget_bytes"]
    assert s["num_evictions"] > 0 and s["num_rematerializations"] > 0 and s["remat_seconds"] > 0
    assert pymem.max_memory_allocated() == s["allocated_bytes.peak"]
    assert "budget" in summary and "3.0 MiB" in summary and f"{s['num_evictions']} (" in summary


def test_logging_is_silent_by_default_and_reports_when_asked(caplog, capsys):
    with pymem.budget("1MiB"):
        pass
    assert capsys.readouterr().err == ""
    with caplog.at_level(logging.INFO, logger="pymem"):
        with pymem.budget("1MiB"):
            pass
    assert any("pymem enabled: budget 1048576 B" in r.message for r in caplog.records)
    assert any("pymem disabled" in r.message for r in caplog.records)


def test_snapshot_opens_in_torch_memory_viz(tmp_path):
    from torch.cuda import _memory_viz as viz

    pymem.record_memory_history(True)
    try:
        with pymem.budget("3MiB"):
            w = torch.randn(128, 128, requires_grad=True)
            x = torch.randn(512, 128)
            for _ in range(12):
                x = torch.tanh(x @ w)
            x.sum().backward()
            snap = pymem.memory_snapshot()
            path = tmp_path / "snap.pickle"
            pymem.dump_snapshot(str(path))
    finally:
        pymem.record_memory_history(False)
    seg = snap["segments"][0]
    assert seg["total_size"] + snap["segments"][1]["total_size"] == 3 << 20
    trace = snap["device_traces"][0]
    assert {e["action"] for e in trace} == {"alloc", "free_completed"}
    assert any(e["frames"][0]["name"] == "alloc" for e in trace)  # plain allocations are there too
    assert any(e["frames"][0]["name"] == "free" for e in trace)
    evicts = [e for e in trace if e["frames"][0]["name"].startswith("pymem evict")]
    assert evicts and all(e["action"] == "free_completed" for e in evicts)
    remats = [e for e in trace if e["frames"][0]["name"].startswith("pymem rematerialize")]
    assert remats and all(e["action"] == "alloc" for e in remats)
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)
    assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    names = [e["frames"][0]["name"] for e in snap["device_traces"][0]]
    assert any(n.startswith("pymem evict") for n in names)
    assert any(n.startswith("pymem rematerialize") for n in names)
    assert "entries" in viz.trace(snap) and "segment" in viz.segsum(snap)
    assert "<html" in viz.trace_plot(snap).lower()
    import pickle
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"][0]["total_size"] == seg["total_size"]
    import subprocess
    import sys
    out = tmp_path / "out.html"
    p = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and out.stat().st_size > 1000, p.stderr
    with pytest.raises(RuntimeError, match="pymem is not enabled"):
        pymem.memory_snapshot()


def test_history_is_opt_in_bounded_and_labels_events():
    arena = pymem.Arena(1 << 20)
    a = arena.allocate(1000)
    assert arena.history() == [] and not arena.recording_history  # off by default
    arena.set_history(3)
    b = arena.allocate(600)
    arena.label_next_free(b, "pymem evict test")
    arena.free(b)
    c = arena.allocate(512)
    arena.label_last_alloc(c, "pymem rematerialize test")
    arena.free(a)
    events = arena.history()
    assert [(e[0], e[1], e[2], e[4]) for e in events] == [  # the oldest (b's allocation) fell out
        ("free_completed", b, 1024, "pymem evict test"), ("alloc", c, 512, "pymem rematerialize test"),
        ("free_completed", a, 1024, "")]
    with pytest.raises(ValueError, match="action must be 'alloc' or 'free_completed'"):
        arena.history_note("moved", c, 512, "x")
    arena.set_history(0)
    assert arena.history() == [] and not arena.recording_history
    with pytest.raises(ValueError, match="max_entries must be a positive int"):
        pymem.record_memory_history(True, max_entries=0)


def test_many_enable_disable_cycles_in_one_process():
    """Each enable installs a fresh arena; a long program may cycle through many budget scopes."""
    x = torch.ones(1000)
    kept = []
    for i in range(100):
        with pymem.budget("1MiB"):
            kept.append(x * i)  # made in that scope's arena, outlives it
    assert all(torch.equal(k, torch.full((1000,), float(i))) for i, k in enumerate(kept))
    del kept  # freed into their (uninstalled) arenas
