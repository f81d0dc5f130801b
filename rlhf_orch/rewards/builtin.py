"""Rule-based rewards for the synthetic tasks: fn(response: str, row: dict) -> float.

`row` is the dataset row the prompt came from (it carries "answer"). These functions are pure and
cheap; they do not see logprobs. `exact_match_token_cost` is dense (one value per response token, from
row["response_ids"]): an example of per-token reward shaping.
"""
from __future__ import annotations

import re

from rlhf_orch.rewards import dense


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


@dense
def exact_match_token_cost(response: str, row: dict, cost: float = 0.01) -> list[float]:
    """Dense: -cost on every response token, and exact_match on the last one (its sum: exact_match - cost * tokens).
    PPO's critic then sees the cost as each token comes, not as one number at the end."""
    out = [-cost] * len(row["response_ids"])
    if out:
        out[-1] += exact_match(response, row)
    return out


def tool_final_answer(response: str, row: dict) -> float:
    """Multi-turn calculator tasks (data builtin:tool_sums): half for a call that got the sum from the tool (an
    observation `=<sum> `), half for the last turn, the text after the tool's last observation (the whole response
    if there is none): the sum exactly, else the share of its characters right in place, less 0.2 per extra
    character, at least 0."""
    found = list(re.finditer(r"=(-?\d+) ", response))
    final = (response[found[-1].end():] if found else response).strip()
    called = 0.5 if found and found[-1].group(1) == str(row["sum"]) else 0.0
    answered = 1.0 if final == str(row["sum"]) else max(0.0, char_accuracy(final, {"answer": row["sum"]}))
    return called + 0.5 * answered


def agent_reward(response: str, row: dict) -> float:
    """The reward an agent function returned (rollout.agent; the rollout manager puts it in the row it scores)."""
    if row.get("agent_reward") is None:
        raise ValueError("the agent returned None for this sample; with reward.function "
                         "rlhf_orch.rewards.builtin:agent_reward every agent call must return a float")
    return float(row["agent_reward"])
