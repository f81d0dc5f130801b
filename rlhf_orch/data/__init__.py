"""Prompt data: synthetic tasks, file datasets (JSONL, JSON, parquet, Arrow; dotted keys, chat rendering) with
row validation, and a resumable batch cursor."""
from rlhf_orch.data.dataset import Cursor, PromptDataset, load_rows
from rlhf_orch.data.prepare import dataset_problems, prepare_rows
from rlhf_orch.data.rows import DataSpec
from rlhf_orch.data.tasks import TASKS, arithmetic_rows, reverse_rows

__all__ = ["Cursor", "DataSpec", "PromptDataset", "TASKS", "arithmetic_rows", "dataset_problems", "load_rows",
           "prepare_rows", "reverse_rows"]
