"""Planning: pure functions from plain records to plain plans (no processes, no I/O)."""
from omnickpt.planner.load_plan import ReadItem, plan_reads
from omnickpt.planner.save_plan import GlobalPlan, ShardRecord, WriteItem, build_global_plan, structure_digest

__all__ = ["GlobalPlan", "ReadItem", "ShardRecord", "WriteItem", "build_global_plan", "plan_reads",
           "structure_digest"]
