"""rlhf_orch/metrics/advice.py: when the slowest group outlasts the train steps that cover it, the advice names the
max_staleness that would hide it, once; otherwise (on-policy, batches on time, too few steps) nothing."""
from rlhf_orch.metrics.advice import StalenessAdvisor


def step(latency=8.2, train=5.8, wait=2.5, step_s=8.4):
    return {"rollout/group_latency_max_s": latency, "perf/train_s": train, "perf/generate_s": wait,
            "perf/step_s": step_s}


def test_advice_names_the_staleness_that_hides_the_slowest_group_once():
    adv = StalenessAdvisor(1)
    said = [adv.observe(step()) for _ in range(8)]
    assert said[:4] == [None] * 4 and said[5:] == [None] * 3     # needs 5 steps, then says it once
    msg = said[4]
    assert "slowest group takes 8.20 s" in msg and "rollout.max_staleness=1" in msg and "max_staleness: 2" in msg
    adv = StalenessAdvisor(1)
    assert [adv.observe(step(latency=12.0)) for _ in range(5)][-1].count("max_staleness: 3") == 1   # ceil(12 / 5.8)
    adv = StalenessAdvisor(1)   # a tiny CPU run: 0.6 s groups, 0.03 s train steps (20 of them): not a staleness matter
    msg = [adv.observe(step(latency=0.6, train=0.03, wait=0.35, step_s=0.4)) for _ in range(5)][-1]
    assert "Generation bounds these steps" in msg and "max_staleness: " not in msg


def test_no_advice_on_policy_when_batches_are_on_time_or_covered():
    for adv, s in [(StalenessAdvisor(0), step()),                    # on-policy: the loop waits by design
                   (StalenessAdvisor(2), step()),                    # 8.2 s < 2 train steps of 5.8 s
                   (StalenessAdvisor(1), step(wait=0.5)),            # the trainer hardly waits
                   (StalenessAdvisor(1), {"perf/train_s": 1.0})]:    # a record without the metric
        assert all(adv.observe(dict(s)) is None for _ in range(10))
    adv = StalenessAdvisor(1)   # medians: one slow step among fast ones says nothing
    assert all(adv.observe(step() if i == 3 else step(latency=3.0, wait=0.2)) is None for i in range(10))


def test_partial_rollouts_extra_lag_counts_as_cover_and_is_offered_when_off():
    adv = StalenessAdvisor(1, extra_lag=1)   # partial rollouts: a late group has 1 + 1 train steps of 5.8 s
    assert all(adv.observe(step()) is None for _ in range(10))
    adv = StalenessAdvisor(1, extra_lag=1)
    msg = [adv.observe(step(latency=13.0)) for _ in range(5)][-1]
    assert "rollout.max_staleness=1 + partial_extra_lag=1" in msg and "max_staleness: 3" in msg
    assert "partial_rollouts: true" not in msg
    adv = StalenessAdvisor(1)
    assert "rollout.partial_rollouts: true" in [adv.observe(step()) for _ in range(5)][-1]
