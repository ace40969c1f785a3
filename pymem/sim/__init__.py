"""The simulator (issue 16): capture a training step on the meta device (capture.py), keep it as
arrays (trace.py), replay it under a budget at GPU scale through the policies and the C++ arena the
runtime uses (replay.py), and read the DTR prototype's simrd logs (simrd.py).
"""
from .capture import capture, capture_model
from .trace import Trace, TraceError, from_step_arrays

__all__ = ["capture", "capture_model", "Trace", "TraceError", "from_step_arrays"]
