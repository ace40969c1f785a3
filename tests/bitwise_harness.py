"""Shared by ``test_models_hf.py`` and ``test_training_loop.py``: measure a workload's unmanaged peak,
run it unmanaged and under ``pymem.enable``, and compare the results bit for bit.

A workload is a factory ``make()`` -> ``step()``: the factory seeds the global RNG and builds the
model, optimizer and batch (so under pymem every one of them lives in the arena); ``step()`` runs one
training step (or one forward pass) and returns what must match: a tensor, or a list/tuple of them
(detached copies). ``step.model`` is the model; its parameters and buffers are compared too.

Comparison is on raw bytes (``pymem.testing.bitwise_equal``), so a NaN equals itself and -0.0
differs from 0.0.
"""
import contextlib
import gc
import os
import signal
import time

import pytest
import torch

import pymem
from pymem.testing import bitwise_equal

import runtime_models as rm


class RunTooLong(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """RunTooLong in the main thread after ``seconds``: a thrashing restore fails instead of hanging."""
    def on_alarm(signum, frame):
        raise RunTooLong(f"{what} did not finish within {seconds} s (thrashing or livelock?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def flat_tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in flat_tensors(v)]
    if isinstance(x, dict):
        return [t for k in sorted(x, key=str) for t in flat_tensors(x[k])]
    return []


def state_of(model) -> list:
    return [p.detach() for p in model.parameters()] + [b.detach() for b in model.buffers()]


def assert_bitwise_equal(what: str, ref, got) -> None:
    ref, got = flat_tensors(ref), flat_tensors(got)
    assert len(ref) == len(got), f"{what}: {len(ref)} tensors unmanaged, {len(got)} managed"
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{what}: tensor {i}: {a.dtype}{tuple(a.shape)} unmanaged, {b.dtype}{tuple(b.shape)} managed"
        if not bitwise_equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            pytest.fail(f"{what}: tensor {i} {a.dtype}{tuple(a.shape)} differs (max |diff| {diff:g})")


measure = rm.measure_run  # (peak, resident) bytes of ``steps`` steps of ``make()``


def measure_peak(make, steps: int) -> int:
    """Peak bytes of every CPU tensor of ``steps`` steps (see ``measure``)."""
    return measure(make, steps)[0]


def run_unmanaged(make, steps: int, untimed: int = 0):
    """(outputs per step, final parameters and buffers, seconds of the steps after the first
    ``untimed``)."""
    step = make()
    outs = [step() for _ in range(untimed)]
    t0 = time.perf_counter()
    outs += [step() for _ in range(steps - untimed)]
    seconds = time.perf_counter() - t0
    state = [t.clone() for t in state_of(step.model)]
    del step
    gc.collect()
    return outs, state, seconds


def budget_at(peak: int, ratio: float) -> int:
    return int(ratio * peak) // 512 * 512


def run_managed(make, steps: int, budget: int, limit_s: float = 60.0, after=None, untimed: int = 0, **options):
    """``steps`` steps under ``pymem.enable(budget)``. Returns (outputs, final parameters and buffers
    cloned under pymem, memory_stats() before disable, seconds of the steps after the first
    ``untimed``, ``after(step)``'s result if given (called under pymem after the steps)). pymem is
    disabled whatever happens."""
    if os.environ.get("PYMEM_VERIFY") == "1":  # bench/stress_bitwise.py: every return checked
        options.setdefault("verify", True)
    pymem.enable(budget=budget, device="cpu", **options)
    try:
        with deadline(limit_s, f"{steps} steps under {budget} B"):
            step = make()
            outs = [step() for _ in range(untimed)]
            t0 = time.perf_counter()
            outs += [step() for _ in range(steps - untimed)]
            seconds = time.perf_counter() - t0
            state = [t.clone() for t in state_of(step.model)]
            extra = after(step) if after is not None else None
        stats = dict(pymem.memory_stats())
    finally:
        pymem.disable()
    del step
    gc.collect()
    return outs, state, stats, seconds, extra


def assert_within_budget(stats: dict, budget: int) -> None:
    assert stats["budget_bytes"] == budget
    assert stats["allocated_bytes.peak"] <= budget, stats
