"""The execution engine: staging, the snapshot/persist save pipeline, parallel reads."""
from omnickpt.engine.load import read_objects, read_tensors
from omnickpt.engine.manifest import build_manifest
from omnickpt.engine.persist import RankResult, persist
from omnickpt.engine.save import collect_garbage, snapshot, tensor_bytes_view
from omnickpt.engine.staging import StagingPool

__all__ = ["RankResult", "StagingPool", "build_manifest", "collect_garbage", "persist", "read_objects",
           "read_tensors", "snapshot", "tensor_bytes_view"]
