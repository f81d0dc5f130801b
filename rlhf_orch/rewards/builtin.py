"""Rule-based rewards for the synthetic tasks: fn(response: str, row: dict) -> float.

`row` is the dataset row the prompt came from (it carries "answer"). These functions are pure and
cheap; they do not see token ids or logprobs.
"""
from __future__ import annotations


def exact_match(response: str, row: dict) -> float:
    """1.0 if the response, stripped, equals the row's answer, else 0.0."""
    return 1.0 if response.strip() == str(row["answer"]).strip() else 0.0


def numeric_closeness(response: str, row: dict, scale: float = 5.0) -> float:
    """1.0 for the right number, falling linearly to 0 at `scale` away; 0 for a non-number."""
    try:
        value = float(response.strip())
    except ValueError:
        return 0.0
    return max(0.0, 1.0 - abs(value - float(row["answer"])) / scale)


def char_accuracy(response: str, row: dict) -> float:
    """Fraction of answer characters matched in place, minus a penalty for extra characters."""
    ans = str(row["answer"])
    hits = sum(a == b for a, b in zip(response, ans))
    return hits / max(1, len(ans)) - 0.2 * max(0, len(response) - len(ans))
