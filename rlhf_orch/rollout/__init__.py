"""Streaming rollouts: the scheduler of prompt groups under a staleness bound, and step batches from them.

No Ray here: actors/rollout_manager.py is the actor that drives these against real engines and reward workers.
"""
from rlhf_orch.rollout.scheduler import Group, GroupScheduler

__all__ = ["Group", "GroupScheduler"]
