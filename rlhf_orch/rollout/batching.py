"""One training step's batch from finished groups: advantages, padded tensors, one shard per trainer rank,
and the step's flat `rollout/` and `staleness/` metrics.

Groups are laid out in the order given (the scheduler gives draw order), each group's samples in engine
order, and the group id of a sample is its group's position in the batch: with max_staleness 0 this is
exactly the tensor the synchronous loop built. It checks the staleness bound on every token once more,
because a wrong batch must never reach the trainer. With `balance_tokens` (set with a token budget) the
shards are balanced by token count rather than contiguous (trainer.batch.shard_balanced). With a dense reward
the batch's rewards are [B, T] (each response token's value at its position); advantages of outcome algorithms
come from the per-sample sums. No Ray, no model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlhf_orch.algorithms.base import Algorithm
from rlhf_orch.algorithms.off_policy import staleness_histogram
from rlhf_orch.rollout.scheduler import Group
from rlhf_orch.rollout_utils import check_versions, rollout_metrics
from rlhf_orch.trainer.batch import build_train_batch, shard, shard_balanced
from rlhf_orch.types import Prompt, Sample, TrainBatch


@dataclass
class StepBatch:
    shards: list[TrainBatch]
    tokens: float                                     # response tokens of the whole batch (loss normaliser)
    metrics: dict[str, float]
    example: tuple[str, str, float] = ("", "", 0.0)   # (prompt, response, reward) of the first sample, for logs
    sources: list[list[int]] = field(default_factory=list)   # (epoch, row) of each group, for the ledger


def assemble(groups: list[Group], trained_version: int, max_staleness: int, algorithm: Algorithm,
             pad_id: int, num_ranks: int, gen_seconds: float, balance_tokens: bool = False) -> StepBatch:
    prompts: list[Prompt] = []
    samples: list[Sample] = []
    rewards: list[float] = []
    per_token: list[list[float]] = []
    for i, g in enumerate(groups):
        p = g.prompt
        prompts.append(Prompt(index=i, text=p.text, token_ids=p.token_ids, row=p.row, source=p.source))
        for s, r in zip(g.samples, g.rewards):
            s.prompt_index = i
            samples.append(s)
            rewards.append(r)
        if g.token_rewards is not None:
            per_token.extend(g.token_rewards)
    check_versions(samples, trained_version, max_staleness)
    reward_t = torch.tensor(rewards)
    group_ids = torch.tensor([s.prompt_index for s in samples])
    lengths = torch.tensor([s.trained_tokens for s in samples])   # the loss tokens (reinforce_pp_baseline)
    adv = algorithm.outcome_advantages(reward_t, group_ids, response_lengths=lengths)   # dense: outcome algorithms take its sum
    batch = build_train_batch(samples, adv, pad_id, rewards=reward_t)
    if per_token:
        batch.rewards = token_reward_tensor(samples, per_token, batch.response_mask)
    metrics = rollout_metrics(prompts, samples, reward_t, adv, gen_seconds)
    metrics.update(staleness_metrics(samples, trained_version, max_staleness))
    metrics["rollout/groups"] = float(len(groups))
    metrics.update(turn_metrics(samples))
    if any("model" in g.reward_parts for g in groups):   # a reward model scores: each source's mean, unweighted
        for source in ("function", "model"):
            vals = [v for g in groups for v in g.reward_parts.get(source, [])]
            if vals:
                metrics[f"reward/{source}_mean"] = sum(vals) / len(vals)
    first = samples[0]
    if balance_tokens:
        shards, _ = shard_balanced(batch, num_ranks)   # the trainer ranks report the resulting imbalance
    else:
        shards = shard(batch, num_ranks)
    return StepBatch(shards=shards, tokens=float(batch.response_mask.sum()), metrics=metrics,
                     example=(prompts[first.prompt_index].text, first.text, rewards[0]),
                     sources=[list(p.source) for p in prompts])


def token_reward_tensor(samples: list[Sample], per_token: list[list[float]], response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] rewards in the batch's token convention: sample b's value for response token j at position
    len(prompt_ids) + j, 0 elsewhere. Token-level algorithms take it as it is (algorithms.ppo.token_rewards)."""
    if len(per_token) != len(samples):
        raise ValueError(f"dense rewards for {len(per_token)} of {len(samples)} samples: every group of a step is "
                         "scored by the same function")
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    for b, (s, values) in enumerate(zip(samples, per_token)):
        if len(values) != len(s.response_ids):
            raise ValueError(f"sample {b}: {len(values)} dense rewards for {len(s.response_ids)} response tokens")
        p = len(s.prompt_ids)
        out[b, p:p + len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def staleness_metrics(samples: list[Sample], trained_version: int, max_staleness: int) -> dict[str, float]:
    """Tokens at each version lag (`staleness/lag_k`), and the share of samples spanning a weight update."""
    width = max((len(s.response_ids) for s in samples), default=0)
    versions = torch.zeros((len(samples), max(width, 1)), dtype=torch.long)
    mask = torch.zeros_like(versions, dtype=torch.float32)
    for b, s in enumerate(samples):
        v = s.versions
        if v:
            versions[b, :len(v)] = torch.tensor(v)
            mask[b, :len(v)] = torch.tensor(s.loss_mask, dtype=torch.float32) if s.loss_mask else 1.0   # trained
    out = staleness_histogram(versions, mask, trained_version, max_staleness)
    out["staleness/spanning_frac"] = sum(s.min_version != s.max_version for s in samples) / max(1, len(samples))
    return out


TURN_KEYS = ("turns", "tool_calls", "tool_errors", "observation_tokens", "truncated")


def turn_metrics(samples: list[Sample]) -> dict[str, float]:
    """Multi-turn samples only (rollout.multi_turn): per-trajectory means of turns, tool calls, tool errors and
    observation tokens, and the share truncated by max_total_tokens (`rollout/<key>_mean`); {} for single-turn."""
    stats = [s.turn_stats for s in samples if s.turn_stats]
    if not stats:
        return {}
    return {f"rollout/{k}_mean": sum(st.get(k, 0) for st in stats) / len(stats) for k in TURN_KEYS}
