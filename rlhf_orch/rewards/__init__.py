"""Reward sources. Rule-based functions live in builtin.py; users point `reward.function` at their own
`package.module:function` with the signature fn(response: str, row: dict) -> float. A learned reward model
(`reward.model_path`, an AutoModelForSequenceClassification with one label) is scored by model.py; scorer.py
combines the two as function_weight * fn + model_weight * rm.

Importing this package imports neither torch nor transformers (the config loader imports it)."""

# `reward.function: null` (or "") is stored as this path, so the config always names an importable function;
# the scorer recognises it and calls nothing (the reward is then the model's alone).
NO_FUNCTION = "rlhf_orch.rewards:no_function"


def no_function(response: str, row: dict) -> float:
    """Placeholder for `reward.function: null`: never called by the scorer."""
    return 0.0


__all__ = ["NO_FUNCTION", "no_function"]
