"""GPU placement logic on a CPU machine: a local Ray that declares 4 logical GPUs takes the placement
group a 4-GPU run asks for, so the bundle shapes and each actor's GPU share are checked without GPUs.
(What Ray then makes visible in each actor was seen working on the GPU machine for shared and single-GPU
bundles; a 2-GPU engine bundle has not run there yet.)"""
import pytest
import ray

from driver.placement import allocate
from rlhf_orch.config.schema import ExperimentConfig

pytestmark = pytest.mark.integration


def _cfg():
    return ExperimentConfig.model_validate({
        "trainer": {"num_ranks": 2, "device": "cuda", "zero_stage": 3},
        "engines": [
            {"kind": "vllm", "name": "coloc", "placement": "colocated"},
            {"kind": "vllm", "name": "tp2", "placement": "dedicated", "tensor_parallel_size": 2},
        ],
    })


def test_tp_engine_gets_one_bundle_with_all_its_gpus_and_colocated_engine_shares_rank0():
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False)
    try:
        p = allocate(_cfg(), timeout_s=30)
        try:
            # ranks 0 and 1, then one 2-GPU bundle for the TP engine: 4 GPUs, as a TP group must sit on one node
            assert [b["GPU"] for b in p.pg.bundle_specs] == [1.0, 1.0, 2.0]
            assert p.trainer_bundles == [0, 1]
            assert p.engine_bundles == {"coloc": [0], "tp2": [2]}
            # rank 0 and the colocated engine split bundle 0, so Ray puts both on the same GPU
            assert p.options(0, "r0", {})["num_gpus"] == 0.5
            assert p.options(1, "r1", {})["num_gpus"] == 1.0
            # the TP engine's one actor holds both GPUs: Ray makes exactly those visible to it
            assert p.options(2, "tp2", {})["num_gpus"] == 2.0
        finally:
            p.release()
    finally:
        ray.shutdown()
