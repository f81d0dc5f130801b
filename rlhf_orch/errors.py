"""The project's error hierarchy.

Every error a user can cause or meet derives from `RLHFOrchError`, so launch.py can catch one type,
print one clear line per problem and exit non-zero. All classes are plain Exceptions with a single
message argument so they pickle across Ray actor boundaries unchanged.

This module does not log or format anything; callers choose how to present the message.
"""


class RLHFOrchError(Exception):
    """Base class: a message that names what is wrong and how to fix it."""


class ConfigError(RLHFOrchError):
    """The experiment config (YAML, overrides or CLI flags) is invalid. One line per problem."""

    def __init__(self, problems):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))

    def __reduce__(self):
        return (type(self), (self.problems,))


class DataError(RLHFOrchError):
    """A prompt dataset is missing, unreadable or has malformed rows."""


class RewardError(RLHFOrchError):
    """A reward function failed to import, has the wrong signature, or returned a bad value."""


class EngineError(RLHFOrchError):
    """A rollout engine failed to start, generate, or load weights."""


class WeightSyncError(RLHFOrchError):
    """A weight sync failed: transport error, timeout, or checksum mismatch."""


class TrainerError(RLHFOrchError):
    """The trainer failed to initialise or to take a step."""


class RolloutError(RLHFOrchError):
    """The rollout manager cannot fill a batch (staleness bound, filtering cap) or lost track of a group."""


class ToolError(Exception):
    """A tool of a multi-turn rollout could not answer (rlhf_orch/rollout/): its message becomes the observation, so
    it never ends a run and is not an RLHFOrchError."""


class CheckpointError(RLHFOrchError):
    """A checkpoint could not be written or committed (the OS cause, e.g. disk full, is in the message)."""


class RunStopped(RLHFOrchError):
    """The run was asked to stop (SIGTERM, `ray job stop`, Ctrl-C); what it had is saved."""


ACTOR_DIED = "an actor died"   # in every error made from a Ray actor death (actors/common.py)


def is_actor_death(err: BaseException) -> bool:
    """True for errors caused by a dead actor process: a run restarted from its checkpoint can get past them."""
    return ACTOR_DIED in str(err)
