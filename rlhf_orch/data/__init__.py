"""Prompt data: synthetic tasks, JSONL loading with row validation, and a resumable batch cursor."""
from rlhf_orch.data.dataset import Cursor, PromptDataset, load_rows
from rlhf_orch.data.tasks import TASKS, arithmetic_rows, reverse_rows

__all__ = ["Cursor", "PromptDataset", "TASKS", "arithmetic_rows", "load_rows", "reverse_rows"]
