"""What a run's placement group asks for, and whether a machine or a cluster can give it.

One bundle per device slot (driver/placement.py builds the placement group from `bundle_resources`): trainer rank r
is bundle r, a colocated engine shares a rank's bundle, a dedicated engine has one bundle of
`tensor_parallel_size` GPUs. On cuda a bundle is {GPU: n, CPU: 1}; on cpu a bundle stands in for a device and
takes CPU_SLOT logical CPUs, so 2 ranks + 2 engines fit in one core's worth (the configs' ray.num_cpus=2 on a
2-core machine). Separate reference workers, separate critic ranks (a GPU or a share of one each) and reward-model
workers (one GPU each) on cuda ask Ray outside the bundles (`outside_gpus`); the GPU count includes them.

`fit_problem` compares the demand with what is offered and says both, in one line naming the fields to change.
It is called before Ray for a local run (launch.py: the machine's CPUs and GPUs) and right after ray.init for a
cluster (driver/placement.py: ray.cluster_resources()), so a run that cannot fit fails in seconds instead of
after a placement-group wait of ray.get_timeout_s. No Ray import here.
"""
from __future__ import annotations

import os

CPU_SLOT = 0.25   # logical CPUs per slot on CPU runs


def slot_gpus(cfg) -> list[int]:
    """GPUs of each bundle: 1 per trainer rank, then tensor_parallel_size per dedicated engine instance."""
    gpus = [1] * cfg.trainer.num_ranks
    for e in cfg.engines:
        if e.placement == "dedicated":
            gpus.extend([e.tensor_parallel_size] * e.count)
    return gpus


def bundle_resources(cfg) -> list[dict[str, float]]:
    if cfg.trainer.device == "cuda":
        return [{"GPU": float(g), "CPU": 1.0} for g in slot_gpus(cfg)]
    return [{"CPU": CPU_SLOT} for _ in slot_gpus(cfg)]


def outside_gpus(cfg) -> dict[str, float]:
    """GPUs asked for outside the placement group's bundles, by whom: separate reference workers and critic ranks
    (trainer.device cuda; their gpus_per_worker / gpus_per_rank each) and reward-model workers (reward.device cuda, one
    GPU each)."""
    out = {}
    if cfg.trainer.device == "cuda" and cfg.reference.placement == "separate":
        out["reference.num_workers"] = cfg.reference.num_workers * cfg.reference.gpus_per_worker
    if cfg.trainer.device == "cuda" and cfg.critic.placement == "separate":   # set only with a critic (checks.py)
        out["critic.num_ranks"] = cfg.critic.num_ranks * cfg.critic.gpus_per_rank
    if cfg.reward.device == "cuda" and cfg.reward.model_path:
        out["reward.num_workers"] = cfg.reward.num_workers
    return out


def _demand_words(cfg) -> str:
    dedicated = sum(e.count for e in cfg.engines if e.placement == "dedicated")
    words = f"trainer.num_ranks {cfg.trainer.num_ranks} + {dedicated} dedicated engine{'s' * (dedicated != 1)}"
    return words + "".join(f" + {n:g} ({field})" for field, n in outside_gpus(cfg).items())


def fit_problem(cfg, cpus: float, gpus: float, where: str, largest_node_gpus: float | None = None) -> str | None:
    """One line when the run's bundles need more CPUs or GPUs than `where` offers (`cpus`, `gpus`), else None."""
    bundles = bundle_resources(cfg)
    need_cpu = sum(b["CPU"] for b in bundles)
    need_gpu = sum(b.get("GPU", 0.0) for b in bundles) + sum(outside_gpus(cfg).values())
    fix = ("lower trainer.num_ranks or the engines' count (or tensor_parallel_size), put engines on the trainer's "
           "devices with placement: colocated")
    if cfg.trainer.device == "cuda":
        if need_gpu > gpus:
            parts = [str(int(b["GPU"])) for b in bundles] + [format(n, "g") for n in outside_gpus(cfg).values()]
            return (f"trainer.num_ranks: the run needs {need_gpu:g} GPUs ({_demand_words(cfg)}, {' + '.join(parts)})"
                    f" but {where} has {gpus:g}; {fix}, or run on "
                    "a machine or cluster (ray.address) with more GPUs")
        widest = max(b["GPU"] for b in bundles)
        if largest_node_gpus is not None and widest > largest_node_gpus:
            return (f"engines.*.tensor_parallel_size: an engine needs {widest:g} GPUs on one node but the largest node "
                    f"of {where} has {largest_node_gpus:g}; lower tensor_parallel_size to at most {largest_node_gpus:g}")
    if need_cpu > cpus:
        per = "1 CPU per GPU slot" if cfg.trainer.device == "cuda" else f"{CPU_SLOT:g} CPU per slot"
        return (f"trainer.num_ranks: the run needs {need_cpu:g} CPUs ({_demand_words(cfg)}, {per}) but {where} has "
                f"{cpus:g}; {fix}, or raise ray.num_cpus")
    return None


def local_fit_problem(cfg, environ=None) -> str | None:
    """The check of a run that starts its own Ray on this machine; None when it joins a cluster (checked by
    driver/placement.py once Ray is up) or fits."""
    environ = os.environ if environ is None else environ
    if cfg.ray.address or environ.get("RAY_ADDRESS"):
        return None
    machine = os.cpu_count() or 1
    cpus = cfg.ray.num_cpus if cfg.ray.num_cpus is not None else machine
    where = f"the local Ray (ray.num_cpus {cpus:g})" if cfg.ray.num_cpus is not None else f"this machine ({machine} CPUs)"
    gpus = 0
    if cfg.trainer.device == "cuda":
        import torch
        gpus = torch.cuda.device_count()   # NVML-based: does not initialise CUDA in the driver
        where = f"this machine ({gpus} GPUs, {cpus:g} CPUs)"
    return fit_problem(cfg, cpus, gpus, where)
