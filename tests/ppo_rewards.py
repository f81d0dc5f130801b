"""A reward a critic can learn to predict (importable by Ray workers as tests.ppo_rewards).

1.0 when the response starts with an odd digit, else 0.0: about half the samples score after the warm start,
and once the first token is out the outcome is fixed, so a critic that reads the prefix explains most of the
returns' variance. The PPO test uses it to show the critic learning (explained variance rising).
"""


def starts_with_odd_digit(response: str, row: dict) -> float:
    return 1.0 if response[:1] in "13579" and response[:1] != "" else 0.0
