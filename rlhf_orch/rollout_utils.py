"""Small pure helpers of the RL loop: checking versions,
building warm-start batches and summarising a step's rollouts into flat `rollout/` metrics.

Kept out of launch.py so the loop reads as a story and these pieces are unit-tested on their own.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

from rlhf_orch.errors import EngineError
from rlhf_orch.types import Prompt, Sample


def check_versions(samples: Sequence[Sample], expected: int, max_staleness: int = 0) -> None:
    """Never train on weights staler than allowed: every token of every sample must come from a version in
    [expected - max_staleness, expected] (`expected` is the version being trained; 0 staleness: exactly it)."""
    lo = expected - max_staleness
    stale = {(s.engine, v) for s in samples for v in (s.min_version, s.max_version) if not lo <= v <= expected}
    if stale:
        allowed = f"version {expected}" if not max_staleness else (
            f"versions {lo}..{expected}: a token may lag {max_staleness} (rollout.max_staleness, plus "
            "partial_extra_lag with partial rollouts)")
        raise EngineError(f"rollouts generated with stale weights {sorted(stale)} (expected {allowed}); "
                          "an engine missed a sync")


def warm_start_pairs(rows: Sequence[dict], n: int, real_answers: bool, rng: random.Random) -> list[tuple[str, str]]:
    """(prompt, target) pairs for the supervised warm start. With real_answers=False each target is the
    answer of another random row: the model learns the answer format, not the answers."""
    picks = [rng.choice(rows) for _ in range(n)]
    return [(r["prompt"], str(r["answer"] if real_answers else rng.choice(rows)["answer"])) for r in picks]


def rollout_metrics(prompts: Sequence[Prompt], samples: Sequence[Sample], rewards: torch.Tensor,
                    advantages: torch.Tensor, gen_seconds: float) -> dict[str, float]:
    lens = torch.tensor([s.trained_tokens for s in samples], dtype=torch.float32)   # the model's, not observations
    tokens = float(lens.sum())
    solved = torch.zeros(len(prompts))
    for s, r in zip(samples, rewards.tolist()):
        solved[s.prompt_index] = max(float(solved[s.prompt_index]), r)
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "rollout/reward_max": float(rewards.max()),
        "rollout/best_of_group_mean": float(solved.mean()),
        "rollout/advantage_abs_mean": float(advantages.abs().mean()),
        "rollout/response_len_mean": float(lens.mean()),
        "rollout/stop_frac": sum(s.finish_reason == "stop" for s in samples) / max(1, len(samples)),
        "rollout/samples": float(len(samples)),
        "rollout/tokens": tokens,
        "perf/tokens_per_sec": tokens / max(gen_seconds, 1e-9),
    }


def reward_summary(values: Sequence[float], frac: float = 0.2) -> dict[str, float]:
    """Mean of the first and last `frac` of a reward curve, for the end-of-run report."""
    if not values:
        return {}
    k = max(1, int(len(values) * frac))
    first, last = values[:k], values[-k:]
    return {"reward_first": sum(first) / len(first), "reward_last": sum(last) / len(last), "steps": len(values)}
