"""TieredCheckpointManager, kept under this name for code that imports it from here. It lives in the
omnickpt.memory package now: TieredCheckpointManager in omnickpt/memory/manager.py, TieredSave in
memory/handle.py, MemoryTierOptions in memory/options.py (omnickpt/tiers.py says where the rest of
the memory tier went).
"""
from omnickpt.memory.handle import TieredSave  # noqa: F401
from omnickpt.memory.manager import TieredCheckpointManager  # noqa: F401
from omnickpt.memory.options import MemoryTierOptions  # noqa: F401
from omnickpt.memory.restore import fatal_class as _fatal_class  # noqa: F401  (tests/test_manager_safety.py)

__all__ = ["MemoryTierOptions", "TieredCheckpointManager", "TieredSave"]
