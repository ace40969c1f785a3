"""The simulator (issue 16): capture a training step on the meta device (capture.py), keep it as
arrays (trace.py), replay it under a budget at GPU scale through the policies and the C++ arena the
runtime uses (replay.py), bound what any policy could do there (bound.py), and read the DTR
prototype's simrd logs (simrd.py).
"""
from .bound import lower_bound
from .capture import capture, capture_model
from .trace import Trace, TraceError, from_step_arrays

__all__ = ["capture", "capture_model", "lower_bound", "Trace", "TraceError", "from_step_arrays"]
