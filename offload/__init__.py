"""Activation manager (storage policies: keep / recompute / fp8 / local host / peer rank), buffer
pools, sharded gradients with host accumulation, memory accounting, measured activation bytes.

See [Note: activation storage policies] (``manager.py``), [Note: pools and fences] (``pool.py``),
[Note: sharded gradients] (``gradshard.py``), [Note: measured memory] (``memory.py``) and
[Note: measured saved bytes] (``measure.py``).
"""

from .gradshard import GradShards
from .manager import ActivationManager, OffloadCorruption, Policy, PolicyTable
from .memory import MemoryTracker
from .pool import BufferPool, size_class

__all__ = ["ActivationManager", "BufferPool", "GradShards", "MemoryTracker", "OffloadCorruption", "Policy", "PolicyTable",
           "size_class"]
