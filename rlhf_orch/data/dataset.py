"""Prompt datasets: load and validate rows, then hand out shuffled batches with a resumable cursor.

Rows come from a built-in synthetic task or a file (JSONL, JSON, parquet, Arrow, or a folder of them: read in
sources.py, turned into rows in rows.py); every row has a non-empty string "prompt" (other fields ride along
to the reward function); an optional "max_new_tokens" (and "ignore_eos") bounds that prompt's responses. All
bad rows are reported at once, by line number, before any actor starts. Tokenisation happens here too, so
prompt length limits are checked up front.

This module does not group samples per prompt (the driver repeats each prompt `group_size` times
through the engines) and does not know about Ray.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from rlhf_orch.data.prepare import load_rows  # noqa: F401 (re-exported: the dataset's rows come from here)
from rlhf_orch.errors import DataError
from rlhf_orch.types import Prompt


@dataclass
class Cursor:
    """Where the dataset stands: which epoch, and how far into that epoch's shuffled order."""

    epoch: int = 0
    offset: int = 0


class PromptDataset:
    """Tokenized prompts served in shuffled epochs; `state()`/`restore()` make the order resumable."""

    def __init__(self, rows: list[dict], tokenizer, max_prompt_tokens: int, seed: int = 0):
        self.rows = rows
        self.seed = seed
        self.cursor = Cursor()
        self._order_cache: tuple[tuple[int, int] | None, list[int]] = (None, [])   # ((seed, epoch), order)
        self.token_ids: list[list[int]] = []
        too_long = []
        for i, row in enumerate(rows):
            ids = tokenizer(row["prompt"], add_special_tokens=False).input_ids
            if len(ids) > max_prompt_tokens:
                too_long.append(i)
            self.token_ids.append(ids)
        if too_long:
            raise DataError(f"data.max_prompt_tokens: {len(too_long)} rows are longer than {max_prompt_tokens} "
                            f"tokens (first: row {too_long[0]}); raise the limit or shorten them")
        if any(len(ids) == 0 for ids in self.token_ids):
            raise DataError("data.source: a prompt tokenized to zero tokens; check the tokenizer and the rows")

    def __len__(self) -> int:
        return len(self.rows)

    def _order(self, epoch: int) -> list[int]:
        # Cached: the rollout manager draws one prompt at a time.
        if self._order_cache[0] != (self.seed, epoch):
            order = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._order_cache = ((self.seed, epoch), order)
        return self._order_cache[1]

    def next_batch(self, n: int) -> list[Prompt]:
        """The next `n` prompts, crossing epoch boundaries (each epoch reshuffled) as needed."""
        out: list[Prompt] = []
        while len(out) < n:
            order = self._order(self.cursor.epoch)
            take = order[self.cursor.offset:self.cursor.offset + (n - len(out))]
            for i in take:
                out.append(Prompt(index=len(out), text=self.rows[i]["prompt"], token_ids=self.token_ids[i], row=self.rows[i],
                                  source=(self.cursor.epoch, i)))
            self.cursor.offset += len(take)
            if self.cursor.offset >= len(order):
                self.cursor = Cursor(self.cursor.epoch + 1, 0)
        return out

    def prompt(self, source: tuple[int, int], index: int = 0) -> Prompt:
        """The prompt of an earlier draw (a re-queued group after a resume)."""
        i = int(source[1])
        return Prompt(index=index, text=self.rows[i]["prompt"], token_ids=self.token_ids[i], row=self.rows[i],
                      source=(int(source[0]), i))

    def state(self) -> dict:
        return {"epoch": self.cursor.epoch, "offset": self.cursor.offset, "seed": self.seed}

    def restore(self, state: dict) -> None:
        self.seed = state["seed"]
        self.cursor = Cursor(state["epoch"], state["offset"])
