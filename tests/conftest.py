"""Fixtures shared by the test files."""
import gc

import pytest

import pymem
from pymem.testing import deterministic_cpu

# Every test compares with unmanaged runs in this process: on a fixed thread count, as pymem's own.
deterministic_cpu()


@pytest.fixture
def managed():
    """For a test that enables pymem itself: disabled afterwards whatever happened (disable() is a
    no-op when the test already did it), and what the test left collected."""
    yield
    pymem.disable()
    gc.collect()
