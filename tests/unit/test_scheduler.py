"""The rollout scheduler without Ray: admission under the staleness bound, least-loaded dispatch, deadline-driven
batches, dynamic-sampling refills and the ledger, on hand-worked sequences."""
import itertools

import pytest

from rlhf_orch.errors import EngineError
from rlhf_orch.rollout.batching import staleness_metrics
from rlhf_orch.rollout.scheduler import READY, GroupScheduler, whole_run_ledger
from rlhf_orch.rollout_utils import check_versions
from rlhf_orch.types import Prompt, Sample


def make(k=0, B=4, engines=("a", "b"), first=1, last=100, **kw):
    counter = itertools.count()

    def draw():
        i = next(counter)
        return Prompt(index=0, text=f"p{i}", token_ids=[i], row={}, source=(0, i))
    return GroupScheduler(prompts_per_step=B, group_size=2, max_staleness=k, first_step=first, last_step=last,
                          engines=list(engines), draw=draw, **kw)


def finish(s, plan, rewards=(0.0, 1.0), versions=None):
    """Every dispatched chunk comes back and is scored."""
    for engine, groups in plan:
        samples = [[Sample(0, [], [1], [0.0], "stop", g.admitted_version if versions is None else versions)
                    for _ in range(2)] for g in groups]
        for g in s.on_generated(engine, groups, samples):
            s.on_scored(g, list(rewards), 1.0)


def test_staleness_zero_is_the_synchronous_loop():
    s = make(k=0)
    assert s.budget() == 4 and len(s.admit()) == 4 and s.admit() == []
    plan = s.plan_dispatch()
    # one contiguous chunk per engine, in draw order: the synchronous loop's even split
    assert [(e, [g.gid for g in gs]) for e, gs in plan] == [("a", [0, 1]), ("b", [2, 3])]
    assert s.select_batch(1) is None                  # nothing generated yet
    finish(s, plan)
    batch = s.select_batch(1)
    assert [g.gid for g in batch] == [0, 1, 2, 3]
    s.take(batch)
    assert s.admit() == []                           # no new group before the sync of version 1
    s.set_version(1)
    assert [g.gid for g in s.admit()] == [4, 5, 6, 7]
    assert all(g.deadline == 2 for g in s.groups.values())


def test_staleness_one_admits_a_step_ahead_and_deadlines_bind():
    s = make(k=1)
    assert len(s.admit()) == 8                       # steps 1 and 2 from version 0
    plan = s.plan_dispatch()
    assert [len(gs) for _, gs in plan] == [2, 2, 2, 2]
    assert [e for e, _ in plan] == ["a", "b", "a", "b"]   # least outstanding work each time
    # only the second half finished: they are due at step 2, so step 1 may take them (oldest first)...
    finish(s, plan[2:])
    b1 = s.select_batch(1)
    assert [g.gid for g in b1] == [4, 5, 6, 7]
    s.take(b1)
    s.set_version(1)
    assert len(s.admit()) == 4                       # budget (1+1+1) * 4 = 12
    # ...but step 2 must wait for the groups admitted at version 0 (due at 2), whatever else is ready
    finish(s, s.plan_dispatch())
    assert s.select_batch(2) is None
    finish(s, plan[:2])
    assert [g.gid for g in s.select_batch(2)] == [0, 1, 2, 3]


def test_partial_rollouts_slack_lets_a_late_group_be_trained_a_step_later():
    """rollout.partial_extra_lag 1: at step 2 the groups admitted at version 0 are still running, so step 2 trains
    the four ready ones admitted at version 1 instead of waiting; the late ones are due at step 3, which waits for them
    (no later group may overtake a due one). Their places go back to the budget once a step trained without them, so
    step 3 does not lack the groups step 2 took early; and at the last step's horizon the run draws no more."""
    s = make(k=1, deadline_slack=1)
    assert len(s.admit()) == 8 and {g.deadline for g in s.groups.values()} == {3}
    plan = s.plan_dispatch()
    finish(s, plan[2:])
    s.take(s.select_batch(1))                        # gids 4-7 (admitted at 0, finished first)
    s.set_version(1)
    new = s.admit()
    assert [g.gid for g in new] == [8, 9, 10, 11] and all(g.deadline == 4 for g in new)
    finish(s, s.plan_dispatch())                     # 8-11 finish, 0-3 (version 0) still running
    assert [g.gid for g in s.select_batch(2)] == [8, 9, 10, 11]
    assert s.overdue() == 0
    s.take(s.select_batch(2))                        # trained without 0-3: their places go back to the budget
    assert s.overdue() == 4 and s.budget() == 16
    assert [g.gid for g in s.admit()] == [12, 13, 14, 15]   # still at version 1: for step 3, beside 0-3
    s.set_version(2)
    assert [g.gid for g in s.admit()] == [16, 17, 18, 19]   # (2+1+1) * 4 + 4 late = 20
    finish(s, s.plan_dispatch())
    assert s.select_batch(3) is None                 # 0-3 are due at 3: 12-19 (ready) may not overtake them
    finish(s, plan[:2])
    assert [g.gid for g in s.select_batch(3)] == [0, 1, 2, 3]
    s.take(s.select_batch(3))   # 12-15 (nominally step 3's) gave their places to 0-3: now they are the late ones
    assert s.overdue() == 4 and s.budget() == 20 and s.admit() == [] and s.ledger()["balanced"] == 1
    s = make(k=1, last=2, deadline_slack=1)          # the last step trains everything admitted for the run
    assert len(s.admit()) == 8 and {g.deadline for g in s.groups.values()} == {2}
    s = make(k=1, last=3, deadline_slack=1)          # late places do not come back once the horizon is the last step
    s.admit()
    plan = s.plan_dispatch()
    finish(s, plan[2:])
    s.take(s.select_batch(1))
    s.set_version(1)
    s.admit()
    finish(s, s.plan_dispatch())
    s.take(s.select_batch(2))
    assert s.overdue() == 4 and s.budget() == 12 and s.admit() == []


def test_a_late_partial_groups_first_tokens_pass_only_the_token_lag_bound():
    """A request kept through two syncs (tokens of versions 0, 1, 2) trained at version 2: lag 2 on its first token.
    max_staleness 1 alone refuses it; with partial_extra_lag 1 (bound 2) it is counted as staleness/lag_2."""
    late = Sample(0, [7], [1, 2, 3], [0.0] * 3, "stop", 0, token_versions=[0, 1, 2])
    with pytest.raises(EngineError, match="stale weights"):
        check_versions([late], 2, 1)
    check_versions([late], 2, 2)
    m = staleness_metrics([late], 2, 2)
    assert (m["staleness/lag_0"], m["staleness/lag_1"], m["staleness/lag_2"], m["staleness/max_lag"]) == (1, 1, 1, 2)
    assert m["staleness/spanning_frac"] == 1.0


def test_budget_stops_at_the_last_step_and_ledger_balances():
    s = make(k=2, last=2)
    assert len(s.admit()) == 8                       # not 12: the run has two steps
    finish(s, s.plan_dispatch())
    s.take(s.select_batch(1))
    led = s.ledger()
    assert led["drawn"] == 8 and led["trained"] == 4 and led["buffered"] == 4 and led["balanced"] == 1


def test_filter_refills_and_caps_draws():
    s = make(k=0, B=2, engines=("a",), filter_groups=True, filter_max_draws=2.0)
    s.admit()
    plan = s.plan_dispatch()
    finish(s, plan, rewards=(1.0, 1.0))              # both filtered
    assert s.ledger()["filtered"] == 2 and s.select_batch(1) is None
    assert len(s.admit()) == 2                       # refill: drawn 4 = cap 2.0 * budget 2
    finish(s, s.plan_dispatch(), rewards=(1.0, 1.0))  # equal again, but no replacement may be drawn: kept
    assert s.admit() == []
    led = s.ledger()
    assert led["filtered"] == 2 and led["kept_over_cap"] == 2 and led["balanced"] == 1
    assert [g.gid for g in s.select_batch(1)] == [2, 3]


def test_aborted_groups_are_requeued_and_pending_survives_a_checkpoint():
    s = make(k=1, engines=("a",))
    s.admit()
    (engine, groups), *_ = s.plan_dispatch()
    samples = [[Sample(0, [], [1], [0.0], "abort", 0)] * 2 for _ in groups]
    assert s.on_generated(engine, groups, samples) == []
    assert s.ledger()["aborted"] == 4 and s.ledger()["queued"] == 4
    assert [len(gs) for _, gs in s.plan_dispatch()] == [4]    # out again
    pending = s.pending_sources()
    assert pending == [[0, i] for i in range(8)]
    r = make(k=1, engines=("a",), first=3)
    r.requeue([Prompt(0, "x", [src[1]], {}, tuple(src)) for src in pending])
    r.set_version(2)
    assert [g.prompt.source for g in r.admit()] == [(0, i) for i in range(8)]
    assert r.ledger()["requeued_on_resume"] == 8


def test_ready_groups_only_in_batches():
    s = make(k=0)
    s.admit()
    plan = s.plan_dispatch()
    finish(s, plan[:1])
    assert s.select_batch(1) is None
    assert sum(g.state == READY for g in s.groups.values()) == 2


def test_a_dead_engines_groups_are_requeued_and_served_by_the_others():
    s = make(k=0, B=4)
    s.admit()
    plan = s.plan_dispatch()                          # a: 0,1   b: 2,3
    lost = s.engine_failed("b")
    assert [g.gid for g in lost] == [2, 3] and s.engines == ["a"]
    assert s.ledger()["requeued_on_failure"] == 2 and s.ledger()["balanced"] == 1
    # b's late answer (it returned just before dying) is ignored: the groups are queued again
    finish(s, [p for p in plan if p[0] == "b"])
    assert all(g.state == "queued" for g in lost)
    again = s.plan_dispatch()
    assert [(e, [g.gid for g in gs]) for e, gs in again] == [("a", [2, 3])]
    finish(s, [p for p in plan if p[0] == "a"] + again)
    batch = s.select_batch(1)
    assert [g.gid for g in batch] == [0, 1, 2, 3]   # same groups, each exactly once
    s.take(batch)
    led = s.ledger()
    assert led["trained"] == 4 and led["dispatched"] == 6 and led["balanced"] == 1


def test_no_engine_left_keeps_groups_queued_until_a_replacement_joins():
    s = make(k=0, B=2, engines=("a",))
    s.admit()
    s.plan_dispatch()
    s.engine_failed("a")
    assert s.plan_dispatch() == [] and s.ledger()["queued"] == 2
    s.add_engine("a#1")
    plan = s.plan_dispatch()
    assert [(e, len(gs)) for e, gs in plan] == [("a#1", 2)] and s.busy("a#1")


# ---- deterministic mode (rollout.deterministic) -----------------------------------------------------

def test_deterministic_batches_take_the_oldest_groups_whatever_finished_first():
    s = make(k=1, deterministic=True)
    s.admit()
    plan = s.plan_dispatch()                          # gids 0-1, 2-3 (step 1), 4-5, 6-7 (step 2)
    finish(s, plan[2:])                               # step 2's groups finished first
    assert s.select_batch(1) is None                  # the default mode would take 4-7 now (test above)
    finish(s, plan[:1])
    assert s.select_batch(1) is None                  # 2 and 3 are still running: the batch waits for them
    finish(s, plan[1:2])
    assert [g.gid for g in s.select_batch(1)] == [0, 1, 2, 3]


def test_deterministic_dispatch_rotates_over_the_engines_whatever_their_load():
    for det, want in ((False, ["a", "a"]), (True, ["a", "b"])):
        s = make(k=1, deterministic=det, dispatch_groups=1, B=2)
        s.admit()
        plan = s.plan_dispatch()
        assert [e for e, _ in plan] == ["a", "b", "a", "b"]
        finish(s, [plan[0], plan[2]])                 # a is idle now, b still busy
        s.set_version(1)
        assert len(s.admit()) == 2
        assert [e for e, _ in s.plan_dispatch()] == want   # least loaded (a, a) or the fixed rotation (a, b)


def test_deterministic_filtering_draws_replacements_only_once_everything_has_settled():
    s = make(k=0, B=2, engines=("a",), filter_groups=True, deterministic=True, dispatch_groups=1)
    s.admit()
    plan = s.plan_dispatch()
    finish(s, plan[:1], rewards=(1.0, 1.0))           # gid 0 filtered while gid 1 still runs
    assert not s.settled() and s.can_admit()         # the manager does not draw now (only when settled)
    assert s.select_batch(1) is None
    finish(s, plan[1:])
    assert s.settled() and s.select_batch(1) is None and s.can_admit()   # too few live groups: draw one more
    (g,) = s.admit()
    assert g.gid == 2
    finish(s, s.plan_dispatch())
    batch = s.select_batch(1)
    assert [g.gid for g in batch] == [1, 2]
    assert s.take(batch) == 1                          # gid 0: filtered before the batch's newest group, so reported now


def test_deterministic_filter_counts_do_not_depend_on_when_later_groups_were_scored():
    s = make(k=1, B=2, engines=("a",), filter_groups=True, deterministic=True, dispatch_groups=1)
    s.admit()
    plan = s.plan_dispatch()                          # gids 0, 1 (step 1), 2, 3 (step 2)
    finish(s, plan[3:], rewards=(1.0, 1.0))           # a step-2 group filtered before step 1's batch
    finish(s, plan[:2])
    assert s.take(s.select_batch(1)) == 0             # gid 3 is reported with the batch that passes it
    finish(s, plan[2:3])
    assert s.settled() and s.select_batch(2) is None  # one live group left: the manager draws one more
    s.set_version(1)
    s.admit()
    finish(s, s.plan_dispatch())
    batch = s.select_batch(2)
    assert [g.gid for g in batch] == [2, 4] and s.take(batch) == 1


def test_a_resumed_runs_ledger_counts_every_segment_once():
    """Issue #31: after a resume the summary's ledger covered only the last segment (240 trained for 45 steps)."""
    # checkpoint after 10 steps of 16 groups: 160 trained, 12 filtered, 5 still queued/running/buffered
    before = {"drawn": 177, "dispatched": 175, "trained": 160, "filtered": 12, "aborted": 3, "requeued_on_resume": 0,
              "kept_over_cap": 1, "requeued_on_failure": 2, "queued": 2, "in_flight": 2, "buffered": 1, "balanced": 1}
    # the resumed segment: the 5 re-queued first (drawn again), then 5 more steps
    after = {"drawn": 90, "dispatched": 90, "trained": 80, "filtered": 6, "aborted": 0, "requeued_on_resume": 5,
             "kept_over_cap": 0, "requeued_on_failure": 0, "queued": 4, "in_flight": 0, "buffered": 0, "balanced": 1}
    led = whole_run_ledger(before, after)
    assert led["trained"] == 240 and led["filtered"] == 18 and led["drawn"] == 177 - 5 + 90
    assert (led["queued"], led["in_flight"], led["buffered"]) == (4, 0, 0) and led["balanced"] == 1
    assert led["requeued_on_resume"] == 5 and led["aborted"] == 3 and led["dispatched"] == 265
    assert whole_run_ledger({}, after) == after                      # a fresh run: its own ledger
    chained = whole_run_ledger(led, {**after, "trained": 16, "drawn": 20, "filtered": 0, "queued": 4})
    assert chained["trained"] == 256 and chained["balanced"] == 1   # a checkpoint of the resumed run holds it all


def test_spanning_samples_are_counted_when_generated_filtered_or_not():
    """`spanning_samples` counts every finished sample whose tokens came from two weight versions, also in groups
    dynamic sampling drops later (the trained-batch metric `staleness/spanning_frac` cannot see those); aborted
    groups are re-queued, not counted."""
    s = make(k=1, B=2, filter_groups=True)
    s.admit()
    plan = s.plan_dispatch()
    (ea, ga), (eb, gb) = plan[0], plan[1]
    spans = [[Sample(0, [], [1, 2], [0.0, 0.0], "stop", 0, token_versions=[0, 1]),
              Sample(0, [], [1], [0.0], "stop", 0)] for _ in ga]
    for g in s.on_generated(ea, ga, spans):
        s.on_scored(g, [1.0, 1.0], 1.0)            # all rewards equal: filtered
    assert s.ledger()["filtered"] == len(ga) and s.ledger()["spanning_samples"] == len(ga)
    aborted = [[Sample(0, [], [1, 2], [0.0, 0.0], "abort", 0, token_versions=[0, 1])] * 2 for _ in gb]
    assert s.on_generated(eb, gb, aborted) == [] and s.ledger()["spanning_samples"] == len(ga)
