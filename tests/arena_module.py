"""Which compiled arena the arena tests run against.

Normally pymem._C. With PYMEM_ARENA_MODULE=/path/to/_C_asan*.so (set by test_sanitizers.py) the
torch-free ASan/UBSan build, which raises MemoryError where pymem raises OutOfBudgetError.
"""
import importlib.util
import os

_path = os.environ.get("PYMEM_ARENA_MODULE")
if _path:
    _spec = importlib.util.spec_from_file_location("_C_asan", _path)
    C = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(C)
    assert C.HAS_TORCH_HOOK is False  # the torch-free sanitizer build, not pymem._C
    OutOfBudget = MemoryError
else:
    import pymem

    C = pymem._C
    OutOfBudget = pymem.OutOfBudgetError
