"""A reward a critic can learn to predict (importable by Ray workers as tests.ppo_rewards).

1.0 when the response starts with an odd digit, else 0.0: about half the samples score after the warm start,
and once the first token is out the outcome is fixed, so a critic that reads the prefix explains most of the
returns' variance. The PPO test uses it to show the critic learning (explained variance rising).

Two dense versions of it (one value per response token) check that per-token rewards reach the trainer:
`..._on_last_token` puts the whole reward on the last token (so PPO must train exactly as with the scalar one),
`..._split` half on the first token and half on the last (the same sum, different returns).
`..._last_token_then_split` is the first for the first 3 steps' samples its reward worker scores, the second after
(one run checks both: test_ppo_run.py).
"""
import itertools

from rlhf_orch.rewards import dense


def starts_with_odd_digit(response: str, row: dict) -> float:
    return 1.0 if response[:1] in "13579" and response[:1] != "" else 0.0


@dense
def starts_with_odd_digit_on_last_token(response: str, row: dict) -> list[float]:
    out = [0.0] * len(row["response_ids"])
    if out:
        out[-1] = starts_with_odd_digit(response, row)
    return out


@dense
def starts_with_odd_digit_split(response: str, row: dict) -> list[float]:
    out = [0.0] * len(row["response_ids"])
    if out:
        half = starts_with_odd_digit(response, row) / 2
        out[0] += half
        out[-1] += half
    return out


LAST_TOKEN_SAMPLES = 3 * 16 * 8   # 3 steps of configs/tiny_cpu_ppo.yaml (16 prompts x 8 samples)
_scored = itertools.count(1)      # calls in this process (next() on it is atomic: safe from worker threads too)


@dense
def starts_with_odd_digit_last_token_then_split(response: str, row: dict) -> list[float]:
    """`..._on_last_token` for the first LAST_TOKEN_SAMPLES calls in this process, `..._split` after. One reward worker
    (the default) at max_staleness 0 scores each step's samples after the step before trained, so steps 1-3 are
    the last-token run's and step 4 the split's. launch.py's pre-launch check calls it in the driver, not the worker."""
    if next(_scored) <= LAST_TOKEN_SAMPLES:
        return starts_with_odd_digit_on_last_token(response, row)
    return starts_with_odd_digit_split(response, row)
