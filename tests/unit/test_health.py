"""When the rollout manager calls an engine hung: busy, not paused on purpose, and no progress for the limit."""
from rlhf_orch.rollout.health import HealthTracker, call_deadline_s


def test_stall_needs_work_no_progress_and_no_pause():
    h = HealthTracker(stall_s=10)
    assert h.observe("a", 5, busy=True, paused=False, now=0) is None
    assert h.observe("a", 5, busy=True, paused=False, now=9) is None
    assert h.observe("a", 5, busy=True, paused=False, now=10) == 10           # stalled
    assert h.observe("a", 6, busy=True, paused=False, now=11) is None         # progress resets the clock
    assert h.observe("a", 6, busy=True, paused=False, now=20) is None
    assert h.observe("a", 6, busy=True, paused=True, now=30) is None          # a sync pause is not a stall
    assert h.observe("a", 6, busy=True, paused=False, now=39) is None
    assert h.observe("a", 6, busy=False, paused=False, now=60) is None        # idle is not a stall
    assert h.observe("a", 6, busy=True, paused=False, now=65, limit_s=5) == 5  # per-engine limit


def test_engines_reporting_only_calls_get_time_for_their_longest_call():
    assert call_deadline_s(30, 2048, reports_tokens=True) == 30
    assert call_deadline_s(30, 2048, reports_tokens=False) == 30 + 0.05 * 2048
