"""pymem on the CPU keeps MKL and OpenMP on the thread count they were given (fixed_threads.py): a
GEMM that MKL's dynamic adjustment ran on fewer threads would sum in another order, so a recompute
would round otherwise than the run it replaces."""
import pytest

import pymem
from pymem.runtime import fixed_threads

needs_switches = pytest.mark.skipif(not fixed_threads._switches(),
                                    reason="this torch has neither MKL's nor libgomp's thread switches")


@needs_switches
def test_enabling_on_the_cpu_turns_dynamic_threads_off_and_disabling_gives_the_setting_back(managed):
    n = len(fixed_threads._switches())
    fixed_threads.restore((1,) * n)  # as a process starts: MKL adjusts by default
    try:
        assert fixed_threads.dynamic_adjustment() == (1,) * n
        pymem.enable(64 << 20, device="cpu")
        assert fixed_threads.dynamic_adjustment() == (0,) * n
        pymem.disable()
        assert fixed_threads.dynamic_adjustment() == (1,) * n
    finally:
        fixed_threads.fix()  # the suite's own setting (conftest)
