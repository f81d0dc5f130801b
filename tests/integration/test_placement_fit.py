"""A run whose placement group cannot fit the Ray it joined fails at once with what it asked and what the cluster
has, instead of waiting ray.get_timeout_s for a placement group that never becomes ready (driver/placement.py)."""
import time

import pytest
import ray

from driver.placement import allocate
from rlhf_orch.config.schema import ExperimentConfig
from rlhf_orch.errors import ConfigError

pytestmark = pytest.mark.integration


def _cfg(device: str, ranks: int, tp: int = 1):
    return ExperimentConfig.model_validate({
        "experiment": {"name": f"fit-{device}"},
        "trainer": {"num_ranks": ranks, "device": device},
        "engines": [{"kind": "hf", "placement": "dedicated", "tensor_parallel_size": tp}],
    })


def test_a_placement_that_cannot_fit_the_cluster_fails_in_seconds():
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False)
    try:
        for cfg, want in ((_cfg("cuda", 2), "trainer.num_ranks: the run needs 3 GPUs (trainer.num_ranks 2 + 1 dedicated "
                                            "engine, 1 + 1 + 1) but the Ray cluster (1 node: 2 CPUs, 1 GPUs) has 1"),
                          (_cfg("cpu", 10), "trainer.num_ranks: the run needs 2.75 CPUs (trainer.num_ranks 10 + 1 "
                                            "dedicated engine, 0.25 CPU per slot) but the Ray cluster (1 node: 2 CPUs")):
            t0 = time.time()
            with pytest.raises(ConfigError) as e:
                allocate(cfg, timeout_s=600)
            assert time.time() - t0 < 10 and str(e.value).startswith(want), str(e.value)
        p = allocate(_cfg("cpu", 2), timeout_s=30)   # what fits is still placed
        p.release()
    finally:
        ray.shutdown()
