"""A GRPO run across two Ray nodes of one GPU machine (issue #30): two raylets, each owning one GPU (the raylet's
CUDA_VISIBLE_DEVICES names it), labelled rlhf-node=a and rlhf-node=b. The trainer rank goes to node A, the vLLM engine
to node B (the `nodes` section), so the weight sync is an NCCL broadcast between two Ray nodes, chosen from the
locality the actors report. Prints the nodes, the transports and the run's sync and reward figures.

    python bench/multinode_gpu.py --steps 50      # on a 2-GPU machine, vLLM and DeepSpeed installed

On one machine both raylets share an address: what crosses "nodes" here is Ray's placement, the process groups'
addresses taken from Ray and the plan's locality rule, not a network link (bench/RESULTS.md says what that leaves).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import ray
import yaml
from ray.cluster_utils import Cluster

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--config", default=str(ROOT / "configs/vllm_disagg_2gpu.yaml"))
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="multinode_gpu_"))
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    cluster = Cluster()
    nodes = {}
    for name, gpu in (("a", "0"), ("b", "1")):   # each raylet (and its workers) sees only its own GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        nodes[name] = cluster.add_node(num_cpus=8, num_gpus=1, labels={"rlhf-node": name},
                                       **({"include_dashboard": False} if name == "a" else {}))
    os.environ.pop("CUDA_VISIBLE_DEVICES")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    cfg = yaml.safe_load(Path(args.config).read_text())
    cfg["nodes"] = {"trainer": {"rlhf-node": "a"}, "engines": {"rlhf-node": "b"}}
    path = Path(args.out) / "multinode.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    try:
        rc = launch.main(["--config", str(path), f"experiment.output_dir={args.out}", "experiment.name=multinode",
                          f"experiment.steps={args.steps}", "metrics.ray_metrics=false", "metrics.plots=false"])
    finally:
        ray.shutdown()
        cluster.shutdown()
    run = Path(args.out) / "multinode"
    summary = json.loads((run / "summary.json").read_text())
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ids = {n.node_id: name for name, n in nodes.items()}
    print("exit", rc, "status", summary.get("status"))
    print("nodes", {who: ids.get((w or {}).get("node_id"), "?") for who, w in summary["nodes"]["at_start"].items()})
    print("transports", summary["transports"], "syncs", summary["syncs"], "verified", summary["verified_syncs"])
    sync_ms = sorted(r["sync/total_s"] * 1e3 for r in recs if "sync/total_s" in r)
    if sync_ms:
        print(f"sync ms median {sync_ms[len(sync_ms) // 2]:.1f} min {sync_ms[0]:.1f} max {sync_ms[-1]:.1f}")
    k = max(1, len(recs) // 5)
    mean = lambda rs: sum(r["rollout/reward_mean"] for r in rs) / len(rs)   # noqa: E731
    print(f"reward first {k} steps {mean(recs[:k]):.3f}, last {k} steps {mean(recs[-k:]):.3f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
