"""Activation manager (storage policies: keep / recompute / fp8 / local host / peer rank), buffer
pools, sharded gradients with host accumulation, memory accounting. (Measuring a config's saved
activation bytes runs the model, so it lives in the runtime: ``runtime/measure.py``.)

See [Note: activation storage policies] (``manager.py``), [Note: pools and fences] (``pool.py``),
[Note: sharded gradients] (``gradshard.py``) and [Note: measured memory] (``memory.py``).
"""

from .gradshard import GradShards
from .manager import ActivationManager, OffloadCorruption, Policy, PolicyTable
from .memory import MemoryTracker
from .pool import BufferPool, size_class

__all__ = ["ActivationManager", "BufferPool", "GradShards", "MemoryTracker", "OffloadCorruption", "Policy", "PolicyTable",
           "size_class"]
