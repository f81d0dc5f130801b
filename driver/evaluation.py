"""Run one evaluation on the cluster: the engines answer the evaluation prompts, the reward workers score them.

Called by the driver at a step boundary, after the step's sync (Cluster.evaluate), so the engines hold the
just-trained weights. The prompts are split over the engines that have verified weights (contiguous shards, one
generate call each), sent straight to the engine actors, not through the rollout manager, so the manager's prompt
stream and ledger never see them; the samples are scored by the run's reward workers with the same reward
function. The sampling parameters come from rlhf_orch.evaluation (greedy, or seeded per prompt), so the engines'
own sampling RNG, the training stream, is untouched. An engine found dead here is handed to the usual recovery
(driver/recovery.py) and the evaluation is done again, once, on the engines left.

The metrics (`eval/`, rlhf_orch.evaluation.aggregate) and one log line are all it produces; the driver writes them
with the step's metrics.
"""
from __future__ import annotations

import logging
import time

from actors.common import get
from rlhf_orch.errors import EngineError, RewardError
from rlhf_orch.evaluation import EvalSet, aggregate, shard
from rlhf_orch.rewards import with_response_ids

logger = logging.getLogger(__name__)


def run_eval(cluster, es: EvalSet, step: int) -> dict[str, float]:
    """The `eval/` metrics of the engines' current weights (version `step`) on `es`."""
    t0 = time.perf_counter()
    try:
        samples = _generate(cluster, es, step)
    except EngineError as err:
        if not cluster._engines_died(err, f"evaluation after step {step}"):
            raise
        samples = _generate(cluster, es, step)   # once more, on the engines left (replacements have no weights yet)
    rewards = _score(cluster, es, samples)
    per_prompt_r, per_prompt_len, at = [], [], 0
    for group in samples:
        per_prompt_r.append(rewards[at:at + len(group)])
        per_prompt_len.append([len(s.response_ids) for s in group])
        at += len(group)
    m = aggregate(per_prompt_r, per_prompt_len, es.n, es.threshold)
    m["eval/s"] = time.perf_counter() - t0
    at_k = f", pass@{es.n} {m['eval/pass@k']:.4f}" if es.n > 1 else ""   # at n = 1 it is pass@1 again
    logger.info("eval after step %d: reward %.4f, pass@1 %.4f%s, %d prompts x %d, %.2fs", step,
                m["eval/reward_mean"], m["eval/pass@1"], at_k, len(es.prompts), es.n, m["eval/s"])
    return m


def _generate(cluster, es: EvalSet, step: int) -> list[list]:
    """Samples grouped by prompt, in evaluation-set order (n per prompt)."""
    names = [n for n in cluster.engines if n not in cluster.unadmitted]   # replacements without a verified sync wait
    if not names:
        raise EngineError(f"evaluation after step {step}: no engine with synced weights")
    parts = shard(len(es.prompts), len(names))
    refs = []
    for name, (a, b) in zip(names, parts):
        params = es.request_params(cluster.sampling[name], step, range(a, b))
        rows = [p.row for p in es.prompts[a:b]] if cluster.cfg.rollout.agent else None   # an agent reads its row
        refs.append(cluster.engines[name].generate.remote([p.token_ids for p in es.prompts[a:b]], params, None, None,
                                                          rows))
    out = get(refs, cluster.timeout, f"evaluation generate after step {step}", EngineError)
    grouped: list[list] = []
    for name, (a, b), (samples, stats) in zip(names, parts, out):
        cluster.timeline.add(f"engine:{name}", "eval", stats["start"], stats["end"], prompts=b - a)
        groups = [[] for _ in range(b - a)]
        for s in samples:
            groups[s.prompt_index].append(s)
        if any(len(g) != es.n for g in groups):
            raise EngineError(f"engine {name}: evaluation returned {[len(g) for g in groups]} samples per prompt, "
                              f"expected {es.n} each")
        grouped.extend(groups)
    return grouped


def _score(cluster, es: EvalSet, samples: list[list]) -> list[float]:
    """Rewards of every sample (prompt order, then sample order), split over the reward workers."""
    if cluster.cfg.reward.dense:   # scored by the per-token values' sum, as in training
        items = [(s.text, with_response_ids(es.prompts[i].row, s.response_ids)) for i, group in enumerate(samples)
                 for s in group]
    else:
        items = [(s.text, es.prompts[i].row) for i, group in enumerate(samples) for s in group]
    parts = shard(len(items), len(cluster.rewarders))
    out = get([w.score_parts.remote(items[a:b]) for w, (a, b) in zip(cluster.rewarders, parts)], cluster.timeout,
              "evaluation rewards", RewardError)
    return [float(r) for part in out for r in part["rewards"]]
