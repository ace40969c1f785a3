"""The tensor runtime (DTR with a hard budget): see runtime.py."""
from .runtime import Runtime

__all__ = ["Runtime"]
