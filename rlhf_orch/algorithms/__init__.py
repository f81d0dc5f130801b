"""RL algorithm maths: outcome-reward advantage estimators and token-level losses.

Pure tensor functions with no Ray and no model code; see `advantages` and `losses` for shapes.
"""
from rlhf_orch.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    get_advantage_fn,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rlhf_orch.algorithms.losses import (
    KL_ESTIMATORS,
    aggregate_token_loss,
    entropy_from_logits,
    kl_divergence,
    masked_mean,
    masked_sum,
    policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "aggregate_token_loss",
    "compute_advantages",
    "entropy_from_logits",
    "get_advantage_fn",
    "grpo_advantages",
    "kl_divergence",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
]
