"""The execution engine: staging, the snapshot/persist save pipeline, parallel reads."""
from omnickpt.engine.load import read_objects, read_tensors
from omnickpt.engine.save import RankResult, build_manifest, collect_garbage, persist, snapshot, tensor_bytes_view
from omnickpt.engine.staging import StagingPool

__all__ = ["RankResult", "StagingPool", "build_manifest", "collect_garbage", "persist", "read_objects",
           "read_tensors", "snapshot", "tensor_bytes_view"]
