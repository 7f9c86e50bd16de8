"""Planning: pure functions from plain records to plain plans (no processes, no I/O)."""
from omnickpt.planner.load_plan import ReadColumns, ReadItem, ReadPlan, plan_reads
from omnickpt.planner.save_plan import (GlobalPlan, RecordBatch, ShardRecord, WriteItem, build_global_plan,
                                        structure_digest, write_items)

__all__ = ["GlobalPlan", "ReadColumns", "ReadItem", "ReadPlan", "RecordBatch", "ShardRecord", "WriteItem", "build_global_plan", "plan_reads",
           "structure_digest", "write_items"]
