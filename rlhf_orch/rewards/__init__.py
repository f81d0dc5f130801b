"""Reward functions. Rule-based ones live in builtin.py; users point `reward.function` at their own
`package.module:function` with the signature fn(response: str, row: dict) -> float."""
