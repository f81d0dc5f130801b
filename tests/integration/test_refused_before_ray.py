"""Configurations refused before Ray starts: launch exits with 2 (a bad input, as every config error) and one message
naming the field and the fix, and no Ray was started. No actors, no Ray: these run without the shared Ray (its
modules keep only tests that take it)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402

pytestmark = pytest.mark.integration
QUIET = ["ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.ray_metrics=false", "metrics.plots=false"]


def test_infeasible_placement_is_a_clear_error_and_cleans_up(tmp_path, capsys):
    import ray
    # 8 trainer bundles + 1 dedicated engine (the colocated one shares a bundle) = 9 * 0.25 CPUs; the local
    # Ray offers 1: Ray alone would wait forever.
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "experiment.name=big", f"experiment.output_dir={tmp_path}",
                      "trainer.num_ranks=8", "ray.num_cpus=1", "ray.get_timeout_s=5", "metrics.ray_metrics=false"])
    assert rc == 2      # a bad input, as every config error
    err = capsys.readouterr().err
    # caught before Ray starts (rlhf_orch/resources.py), with the field and the fixes
    assert "trainer.num_ranks: the run needs 2.25 CPUs" in err and "raise ray.num_cpus" in err, err
    assert not ray.is_initialized()


def test_a_reference_section_without_kl_is_refused_before_ray(tmp_path, capsys):
    import ray
    rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                      "algorithm.kl_coef=0", *QUIET, "reference.placement=separate", "reference.num_workers=2"])
    assert rc == 2 and not ray.is_initialized()
    err = capsys.readouterr().err
    assert "reference.num_workers: grpo as configured has no KL reference" in err, err
