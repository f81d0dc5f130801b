"""The colocation plan of `trainer.offload: auto` (rlhf_orch/colocation_plan.py): the least movement that fits a
shared GPU in both phases, on realistic numbers (a 1B policy's ~13 GiB of ZeRO state, a vLLM engine of 40 GiB),
on a 141 GB H200 and on a tight 80 GB GPU."""
import pytest

from rlhf_orch.colocation_plan import GiB, GpuMemory, choose, margin, measured_gpus, with_peak

H200 = 140.4      # GiB a 141 GB H200 reports
H100 = 79.6       # an 80 GB H100


def gpu(total, resident, peak, awake, frees, device="gpu0"):
    return GpuMemory(device=device, total=total * GiB, trainer_resident=resident * GiB,
                     trainer_peak=peak * GiB, engines_awake=awake * GiB, sleep_frees=frees * GiB)


def test_margin_is_2_gib_or_5_percent():
    assert margin(H200 * GiB) == pytest.approx(0.05 * H200 * GiB)
    assert margin(20 * GiB) == 2 * GiB


def test_big_gpu_nothing_moves():
    """1B policy: 13 GiB at rest, 30 GiB at its peak; vLLM holds 40 GiB awake (2.5 weights + KV + workspace) and frees
    38 asleep. 40 + 30 + 7 (margin) = 77 of 140 GiB: both fit side by side, nothing moves."""
    plan = choose([gpu(H200, 13, 30, 40, 38)])
    assert (plan.offload, plan.sleep) == (False, False) and plan.moves == 0
    assert plan.name == "nothing moves"
    assert "gpu0" in plan.reason and "140.4" in plan.reason


def test_tight_gpu_engines_sleep_trainer_stays():
    """80 GB: 40 awake + 45 peak + 4 margin = 89 > 79.6, but generate (40 + 13 + 4 = 57) and train with the engine
    asleep (2 + 45 + 4 = 51) fit: only the engine sleeps, the trainer's 13 GiB stay."""
    plan = choose([gpu(H100, 13, 45, 40, 38)])
    assert (plan.offload, plan.sleep) == (False, True)
    assert plan.reason.startswith("nothing moves does not fit (gpu0: engines awake 40.0 + trainer peak 45.0 + "
                                  "margin 4.0 = 89.0 GiB > 79.6 GiB); engines sleep, trainer stays: ")


def test_tighter_gpu_everything_as_configured():
    """vLLM at 80% of an 80 GB GPU (64 GiB awake): with the trainer resident the generate phase needs
    64 + 13 + 4 = 81 > 79.6, so the trainer must offload too."""
    plan = choose([gpu(H100, 13, 45, 64, 62)])
    assert (plan.offload, plan.sleep) == (True, True) and plan.moves == 3
    assert "engines sleep, trainer stays does not fit" in plan.reason and "generate needs" in plan.reason
    assert "moving as configured" in plan.reason


def test_8b_on_h200_moves_everything():
    """An 8B policy's ZeRO state (~120 GiB with Adam) does not share a GPU with a 40 GiB engine."""
    plan = choose([gpu(H200, 120, 130, 40, 38)])
    assert (plan.offload, plan.sleep) == (True, True)
    assert plan.reason.endswith("moving as configured")
    # a step that only just fit with everything moved: said so (the plan cannot do better than the configured moves)
    edge = choose([gpu(H200, 120, 135, 40, 38)])
    assert (edge.offload, edge.sleep) == (True, True) and "even that is tight (gpu0: train needs" in edge.reason


def test_no_sleep_configured_means_nothing_or_offload():
    """Engines with sleep_level 0: sleep is not an option; the tight case falls back to the configured offload."""
    tight = choose([gpu(H100, 13, 45, 40, 0)], can_sleep=False)
    assert (tight.offload, tight.sleep) == (True, False) and tight.name == "trainer offloads, engines stay awake"
    roomy = choose([gpu(H200, 13, 30, 40, 0)], can_sleep=False)
    assert (roomy.offload, roomy.sleep) == (False, False)


def test_every_gpu_must_fit():
    """Two trainer ranks: the plan is one for the run, so the tightest GPU decides."""
    roomy = gpu(H200, 13, 30, 40, 38, "gpu0")
    tight = gpu(H200, 13, 95, 40, 38, "gpu1")    # 40 + 95 + 7 = 142 > 140.4
    plan = choose([roomy, tight])
    assert (plan.offload, plan.sleep) == (False, True)
    assert "gpu1" in plan.reason


def test_without_readings_moves_as_configured():
    plan = choose([], can_offload=True, can_sleep=True)
    assert (plan.offload, plan.sleep) == (True, True) and "no GPU memory readings" in plan.reason


def test_measured_gpus_splits_the_device_between_trainer_and_engines():
    """Readings of the first (configured) step, bytes: awake = engines awake, trainer offloaded (1 GiB left on the
    device); asleep = engines asleep, trainer reloaded (14 GiB); after the step: 30 GiB peak, 13 GiB at rest."""
    total = int(H200 * GiB)
    awake = [{"device": "gpu-a", "total": total, "used": 41 * GiB, "reserved": 1 * GiB}]
    asleep = [{"device": "gpu-a", "total": total, "used": 16 * GiB, "reserved": 14 * GiB}]
    after = [{"device": "gpu-a", "total": total, "used": 54 * GiB, "reserved": 13 * GiB, "peak_reserved": 30 * GiB}]
    [g] = measured_gpus(awake, asleep, after)
    assert g.engines_awake == 40 * GiB and g.engines_asleep == 2 * GiB and g.sleep_frees == 38 * GiB
    assert g.trainer_resident == 13 * GiB and g.trainer_peak == 30 * GiB and g.total == total
    assert measured_gpus(awake, [], after) == [] and measured_gpus(awake, [{}], after) == []


def test_a_larger_peak_later_moves_the_plan_towards_more_movement():
    gpus = [gpu(H200, 13, 30, 40, 38)]
    assert choose(gpus).moves == 0
    grown = with_peak(gpus, 95 * GiB)             # 40 + 95 + 7 > 140.4: the engines must sleep now
    assert grown[0].trainer_peak == 95 * GiB and choose(grown).moves == 1
    assert with_peak(gpus, 1 * GiB)[0].trainer_peak == 30 * GiB   # never lower
