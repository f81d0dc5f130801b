"""Synthetic tasks with verifiable answers, for the built-in default and the tests.

A task is a deterministic list of rows `{"prompt": str, "answer": str, ...}`; rewards check the
answer with rule-based functions in `rlhf_orch.rewards`. The rows are tiny on purpose: a model of a
few hundred thousand parameters learns them within minutes on two CPU cores, so a run shows reward
rising without a GPU. This module does not tokenize, shuffle or batch (see dataset.py).
"""
from __future__ import annotations

import random


def arithmetic_rows(max_operand: int = 9, ops: str = "+", seed: int = 0) -> list[dict]:
    """Every `a<op>b=` with 0 <= a, b <= max_operand; answer is the decimal result."""
    rows = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            for op in ops:
                if op == "-" and a < b:
                    continue  # keep answers non-negative so they stay in the digit vocabulary
                val = {"+": a + b, "-": a - b, "*": a * b}[op]
                rows.append({"prompt": f"{a}{op}{b}=", "answer": str(val)})
    random.Random(seed).shuffle(rows)
    return rows


def reverse_rows(n: int = 200, length: int = 3, seed: int = 0) -> list[dict]:
    """`rev:abc=` -> `cba` over random lowercase strings."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = "".join(rng.choice("abcdefghij") for _ in range(length))
        rows.append({"prompt": f"rev:{s}=", "answer": s[::-1]})
    return rows


def tool_sum_rows(low: int = 10, high: int = 49, seed: int = 0) -> list[dict]:
    """`a+b=` with two-digit operands, for multi-turn runs with the calculator (rollout.multi_turn): "sum" is the value
    the last turn must give (rewards.builtin.tool_final_answer); "answer" is what a warm start with real answers
    teaches, a whole two-turn trajectory in text: the call `calc(a+b)`, the end of the turn, the tool's observation,
    and a last turn with the digits of another row's sum. So the warm start teaches the call and the form of the last
    turn, not its content: repeating the tool's answer is left to RL."""
    rng = random.Random(seed)
    rows = [{"prompt": f"{a}+{b}=", "sum": str(a + b),
             "answer": f"calc({a}+{b})<eos>={a + b} {rng.randint(2 * low, 2 * high)}"}
            for a in range(low, high + 1) for b in range(low, high + 1)]
    rng.shuffle(rows)
    return rows


TASKS = {"arithmetic": arithmetic_rows, "reverse": reverse_rows, "tool_sums": tool_sum_rows}
