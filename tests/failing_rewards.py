"""Reward functions for failure tests (importable by Ray workers as tests.failing_rewards)."""
_calls = {"n": 0}


def fails_on_second_step(response: str, row: dict) -> float:
    """Scores step 1 (128 samples) normally, then raises like a buggy user reward would."""
    _calls["n"] += 1
    if _calls["n"] > 128:
        raise KeyError("answer_v2")
    return 1.0 if response.strip() == row["answer"] else 0.0
