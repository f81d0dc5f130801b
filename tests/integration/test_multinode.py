"""Runs across the nodes of a Ray cluster, proven the way Ray tests multi-node: several raylets on this machine
(`ray.cluster_utils.Cluster`), each a node with its own node id, resources and labels, all on 127.0.0.1.

- Node A (labels rlhf-node=a, rlhf-role=trainer) holds the trainer ranks; nodes B and C (rlhf-role=rollout) the
  engines. The built-in task's GRPO run with its two engines on B and C gives the recorded single-node baseline's
  numbers to 1e-6 (the engines' sampling depends on their slots, not on where they run), every actor's node is
  asserted from summary.json, and IPC is never chosen across nodes: both engines take gloo broadcasts from node A.
- Node B's raylet is killed mid-run (its processes die with it): the engine there is re-created on a surviving
  rollout node with room (C), synced and verified, and the run finishes with the ledger balanced.
"""
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from baselines import baseline  # noqa: E402
from engine_hooks import set_engine_hooks  # noqa: E402

pytestmark = pytest.mark.integration
KEYS = ("train/loss", "train/kl", "train/grad_norm", "rollout/reward_mean", "rollout/reward_std", "sync/digest")
COMMON = ["metrics.ray_metrics=false", "metrics.plots=false", "metrics.trackers=[jsonl]",
          "experiment.log_samples_every=0", "engines.0.placement=dedicated"]


@pytest.fixture(scope="module")
def nodes(request):
    """Three raylets: A (the head, where this driver is), B and C. Each gets one CPU: four device slots of 0.25."""
    request.config.stop_shared_ray()   # through conftest's switch, or its autouse fixture would disconnect us later
    if ray.is_initialized():
        ray.shutdown()
    # The raylets' workers import this checkout and stay on loopback (they inherit the raylets' environment).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A lost node is declared dead after ~3 s of failed health checks (Ray's default: ~15 s).
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "labels": {"rlhf-node": "a", "rlhf-role": "trainer"},
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    handles = {"a": cluster.head_node}
    for name in ("b", "c"):
        handles[name] = cluster.add_node(num_cpus=1, labels={"rlhf-node": name, "rlhf-role": "rollout"})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    ids = {name: h.node_id for name, h in handles.items()}
    yield cluster, handles, ids
    ray.shutdown()
    cluster.shutdown()


def _config(tmp_path: Path, nodes: dict) -> str:
    cfg = yaml.safe_load((ROOT / "configs/tiny_cpu.yaml").read_text())
    cfg["nodes"] = nodes
    path = tmp_path / "multinode.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_trainer_on_a_and_engines_on_b_and_c_give_the_single_node_numbers(tmp_path, nodes):
    _, _, ids = nodes
    cfg = _config(tmp_path, {"trainer": {"rlhf-node": "a"},
                             "per_engine": {"colocated": {"rlhf-node": "b"}, "dedicated": {"rlhf-node": "c"}}})
    assert launch.main(["--config", cfg, f"experiment.output_dir={tmp_path}", "experiment.name=spread",
                        "experiment.steps=3", *COMMON]) == 0
    run = tmp_path / "spread"
    recs, base = _records(run), baseline("tiny_cpu_20steps")["steps"]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for want, got in zip(base, recs):
        for key in KEYS:
            assert got[key] == pytest.approx(want[key], abs=1e-6), (got["step"], key)
        assert got["sync/checksum_ok"] == 1.0 and got["sync/broadcast_engines"] == 2 and got["sync/ipc_engines"] == 0
    summary = json.loads((run / "summary.json").read_text())
    at = {who: w["node_id"] for who, w in summary["nodes"]["at_start"].items()}
    assert at["trainer-0"] == at["trainer-1"] == ids["a"]
    assert at["engine-colocated"] == ids["b"] and at["engine-dedicated"] == ids["c"]
    assert summary["nodes"]["at_end"]["engine-dedicated"]["node_id"] == ids["c"]
    assert set(summary["transports"].values()) == {"broadcast from trainer rank 0"}   # never IPC across nodes
    assert summary["verified_syncs"] == summary["syncs"] == 4 and summary["ledger"]["balanced"] == 1


def test_a_colocated_engine_on_the_trainers_node_still_takes_ipc(tmp_path, nodes):
    """The plan's locality from the nodes actors report: the colocated engine shares rank 0's node (A) and device
    slot, so IPC; the dedicated one on B takes the broadcast. Failing placement is refused before the run waits."""
    _, _, ids = nodes
    cfg = _config(tmp_path, {"trainer": {"rlhf-node": "a"}, "engines": {"rlhf-node": "b"}})
    args = ["--config", cfg, f"experiment.output_dir={tmp_path}", "experiment.steps=1", *COMMON[:-1]]
    assert launch.main([*args, "experiment.name=mixed"]) == 0
    summary = json.loads((tmp_path / "mixed" / "summary.json").read_text())
    at = {who: w["node_id"] for who, w in summary["nodes"]["at_start"].items()}
    assert at["engine-colocated"] == at["trainer-0"] == ids["a"] and at["engine-dedicated"] == ids["b"]
    assert summary["transports"] == {"colocated": "ipc from trainer rank 0", "dedicated": "broadcast from trainer rank 0"}
    t0 = time.time()   # a label no node has: one line naming the field, at once
    rc = launch.main([*args, "experiment.name=nolabel", "nodes.engines={rlhf-node: z}"])
    assert rc != 0 and time.time() - t0 < 60
    assert "nodes.engines" in (tmp_path / "nolabel" / "summary.json").read_text()


def test_losing_an_engine_node_moves_its_engine_to_a_surviving_node(tmp_path, nodes, monkeypatch):
    """The node of engine `dedicated` (B or C, wherever SPREAD put it) loses its raylet at step ~2 of 8."""
    cluster, handles, ids = nodes
    set_engine_hooks(monkeypatch, {"decode_delay_s": 0.05}, {"decode_delay_s": 0.05})   # steps long enough to land in
    cfg = _config(tmp_path, {"trainer": {"rlhf-role": "trainer"}, "engines": {"rlhf-role": "rollout"},
                             "strategy": "SPREAD"})
    run, out = tmp_path / "lose_node", {}

    def kill_its_node_at_step_2():
        try:
            kill_it()
        except Exception as e:   # seen by the assertions on `out`
            out["error"] = repr(e)

    def kill_it():
        metrics, deadline, victim = run / "metrics.jsonl", time.time() + 600, None
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            if victim is None and "lose_node-engine-dedicated" in ray.util.list_named_actors():
                # it answers once its engine is up (its constructor first): minutes on a loaded machine
                node = ray.get(ray.get_actor("lose_node-engine-dedicated").node.remote(), timeout=300)["node_id"]
                victim = next(name for name, i in ids.items() if i == node)
            time.sleep(0.05)
        out.update(t=time.time(), at_step=len(metrics.read_text().splitlines()), victim=victim)
        cluster.remove_node(handles[victim], allow_graceful=False)   # the raylet and its workers, SIGKILLed

    killer = threading.Thread(target=kill_its_node_at_step_2, daemon=True)
    killer.start()
    assert launch.main(["--config", cfg, f"experiment.output_dir={tmp_path}", "experiment.name=lose_node",
                        "experiment.steps=8", "fault_tolerance.replacement_start=wait", *COMMON]) == 0
    killer.join(timeout=5)
    assert "error" not in out, out
    victim = out["victim"]
    other = ids["c" if victim == "b" else "b"]
    assert victim in ("b", "c") and 2 <= out["at_step"] <= 6   # an engine node, mid-run
    recs = _records(run)
    assert [r["step"] for r in recs] == list(range(1, 9)) and all(r["sync/checksum_ok"] == 1.0 for r in recs)
    summary = json.loads((run / "summary.json").read_text())
    start = {who: w["node_id"] for who, w in summary["nodes"]["at_start"].items()}
    assert start["engine-dedicated"] == ids[victim] and start["engine-colocated"] in (ids["b"], ids["c"])
    lost = [f for f in summary["faults"] if f["node"] == ids[victim]]   # one engine, or both if SPREAD packed them
    assert lost and all(f["node_lost"] and f["moved_to"] == other and f["replacement"] for f in lost)
    end = {who: (w or {}).get("node_id") for who, w in summary["nodes"]["at_end"].items()}
    assert end["engine-colocated"] == end["engine-dedicated"] == other
    assert summary["ledger"]["balanced"] == 1 and summary["ledger"]["trained"] == 8 * 16
    assert not summary.get("run_restarts")   # recovered in place: the trainers and the control plane live on A
    for who in ("weight-sync", "rollout-manager", "reward-0"):   # beside the driver, on A, from start to end
        assert start[who] == end[who] == ids["a"], who


def test_losing_the_trainers_node_restarts_from_the_checkpoint_on_another_node(tmp_path, nodes):
    """Two nodes T1 and T2 carry the trainer's label (rlhf-node=t); the ranks run on one of them (not the driver's
    node), which loses its raylet after the step-2 checkpoint. The run restarts by itself on the other from the
    checkpoint and finishes; the restart record names the lost node and what it held. Then the other one is lost too
    and no node is left with the label: a clear stop that names the node and the fix, the checkpoints kept.
    (The spare joins before the loss: on one machine a raylet started after another's death is declared dead with it.)"""
    cluster, _, _ = nodes
    labels = {"rlhf-node": "t", "rlhf-role": "trainer-t"}
    spare = {n.node_id: n for n in (cluster.add_node(num_cpus=1, labels=labels) for _ in range(2))}
    cfg = _config(tmp_path, {"trainer": {"rlhf-node": "t"}, "engines": {"rlhf-role": "rollout"}})
    common = ["--config", cfg, f"experiment.output_dir={tmp_path}", "experiment.steps=6", "trainer.checkpoint_every=2",
              "fault_tolerance.max_run_restarts=1", *COMMON,
              f"experiment.storage_uri=file://{tmp_path}/bucket"]   # checkpoints also uploaded by the ranks' nodes

    def lose_trainer_node(name: str, out: dict):
        try:
            metrics, deadline = tmp_path / name / "metrics.jsonl", time.time() + 600
            while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
                time.sleep(0.05)
            node = ray.get(ray.get_actor(f"{name}-trainer-0").node.remote(), timeout=300)["node_id"]
            out.update(node=node, at_step=len(metrics.read_text().splitlines()))
            cluster.remove_node(spare.pop(node), allow_graceful=False)   # its raylet and workers, SIGKILLed
        except Exception as e:   # seen by the assertions on `out`
            out["error"] = repr(e)

    out: dict = {}
    killer = threading.Thread(target=lose_trainer_node, args=("lose_t", out), daemon=True)
    killer.start()
    rc = launch.main([*common, "experiment.name=lose_t"])
    killer.join(timeout=10)
    assert rc == 0 and "error" not in out, out
    run = tmp_path / "lose_t"
    recs = _records(run)
    assert [r["step"] for r in recs] == list(range(1, 7)) and all(r["sync/checksum_ok"] == 1.0 for r in recs)
    summary = json.loads((run / "summary.json").read_text())
    [restart] = summary["run_restarts"]
    assert set(restart["lost"].values()) == {out["node"]} and {"trainer-0", "trainer-1"} <= set(restart["lost"])
    assert restart["resumed_from"] >= 2 and summary["ledger"]["balanced"] == 1
    assert (tmp_path / "bucket" / "lose_t" / "checkpoints" / "latest").read_text().strip() == "step6"
    [other] = spare   # where the restart put the ranks
    assert summary["nodes"]["at_end"]["trainer-0"]["node_id"] == summary["nodes"]["at_end"]["trainer-1"]["node_id"] == other

    out = {}   # the other one too, and no node is left with the label
    killer = threading.Thread(target=lose_trainer_node, args=("lose_t_for_good", out), daemon=True)
    killer.start()
    assert launch.main([*common, "experiment.name=lose_t_for_good", "fault_tolerance.node_wait_s=15"]) == 1
    killer.join(timeout=10)
    assert out["node"] == other and "error" not in out, out
    run = tmp_path / "lose_t_for_good"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and other[:12] in summary["error"] and "resume=true" in summary["error"]
    assert (run / "checkpoints" / "latest").read_text().strip() in ("step2", "step4")
