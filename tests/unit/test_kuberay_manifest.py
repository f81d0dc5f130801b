"""examples/kuberay/rayjob.yaml: the KubeRay RayJob fields the example relies on, checked against the config its
entrypoint runs. The config must validate, every node-label selector of its `nodes` section must be met by a worker
group's labels with room for its placement-group bundles, and every pod must mount the shared run folder at
experiment.output_dir's parent. Only YAML and the config loader: no Kubernetes, no Ray started."""
import re
import shlex
from pathlib import Path, PurePosixPath

import pytest
import yaml

from rlhf_orch.config.loader import apply_override, load_config, read_yaml
from rlhf_orch.config.nodes import bundle_selectors, matches
from rlhf_orch.resources import outside_gpus, slot_gpus

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "examples/kuberay/rayjob.yaml"
GPU = "nvidia.com/gpu"


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


@pytest.fixture(scope="module")
def job(docs) -> dict:
    jobs = [d for d in docs if d.get("kind") == "RayJob"]
    assert len(jobs) == 1, "one RayJob in the manifest"
    return jobs[0]


def _entrypoint(job: dict) -> tuple[str, list[str]]:
    """(the --config path, the key=value overrides) of `python launch.py --config X [overrides]`."""
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] in (["python", "launch.py"], ["python3", "launch.py"]), argv
    rest = argv[2:]
    if "--config" in rest:
        i = rest.index("--config")
        return rest[i + 1], rest[:i] + rest[i + 2:]
    [flag] = [a for a in rest if a.startswith("--config=")]
    return flag.split("=", 1)[1], [a for a in rest if a != flag]


def _output_dir(config: str, overrides: list[str]) -> str:
    """experiment.output_dir as the job's driver gets it: the file's, then the entrypoint's overrides."""
    raw = read_yaml(ROOT / config)
    for ov in overrides:
        apply_override(raw, ov)
    return (raw.get("experiment") or {}).get("output_dir", "runs")


@pytest.fixture(scope="module")
def cfg(job, tmp_path_factory):
    """The entrypoint's config with its overrides, validated; output_dir pointed at a temp folder, since loading
    creates it (the manifest's is a mount that exists only in the pods)."""
    config, overrides = _entrypoint(job)
    assert (ROOT / config).is_file(), f"the entrypoint's config {config} is not in the repository"
    tmp = tmp_path_factory.mktemp("kuberay_out")
    return load_config(ROOT / config, overrides + [f"experiment.output_dir={tmp}"])


def _groups(job: dict) -> list[dict]:
    return job["spec"]["rayClusterSpec"]["workerGroupSpecs"]


def _pods(job: dict) -> list[tuple[str, dict]]:
    spec = job["spec"]["rayClusterSpec"]
    return [("head", spec["headGroupSpec"]["template"]["spec"])] + [
        (g["groupName"], g["template"]["spec"]) for g in _groups(job)]


def _ray_pin() -> str:
    m = re.search(r'"ray\[default\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject.toml pins ray[default]"
    return m.group(1)


def test_rayjob_top_level_fields(job):
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    name = job["metadata"]["name"]
    # KubeRay: a DNS-1035 label, at most 47 characters (the RayCluster it makes appends 6)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 47, name
    spec = job["spec"]
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["shutdownAfterJobFinishes"] is True
    assert type(spec["ttlSecondsAfterFinished"]) is int and spec["ttlSecondsAfterFinished"] >= 0
    assert type(spec.get("backoffLimit", 0)) is int
    assert spec["rayClusterSpec"]["rayVersion"] == _ray_pin()
    env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}
    assert all(type(v) is str for v in (env.get("env_vars") or {}).values()), "Ray takes env_vars as strings"


def test_entrypoint_runs_launch_with_a_config_of_the_repo_that_validates(job, cfg):
    config, overrides = _entrypoint(job)
    assert config.startswith("configs/") and all("=" in ov or ov.startswith("~") for ov in overrides), overrides
    assert cfg.trainer.device == "cuda" and any(bundle_selectors(cfg)), "a GPU config with a nodes section"


def test_ray_start_params_are_strings_and_labels_are_the_groups_field(job):
    spec = job["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]["rayStartParams"]
    assert isinstance(head, dict) and all(type(v) is str for v in head.values())
    for g in _groups(job):
        params = g["rayStartParams"]
        assert isinstance(params, dict) and all(type(v) is str for v in params.values()), g["groupName"]
        # KubeRay >= 1.5 refuses rayStartParams['labels']; the group's `labels` map becomes `ray start --labels`
        assert "labels" not in params, g["groupName"]
        labels = g["labels"]
        assert labels and all(type(k) is str and type(v) is str for k, v in labels.items()), g["groupName"]


def test_worker_groups_have_names_replica_counts_and_gpus(job):
    names = [g["groupName"] for g in _groups(job)]
    assert len(names) >= 2 and len(set(names)) == len(names), names
    for g in _groups(job):
        counts = [g["replicas"], g["minReplicas"], g["maxReplicas"]]
        assert all(type(c) is int for c in counts), (g["groupName"], counts)
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], (g["groupName"], counts)
        container = g["template"]["spec"]["containers"][0]
        assert container["image"], g["groupName"]
        assert int(str(container["resources"]["limits"][GPU])) > 0, g["groupName"]


def test_every_pod_runs_one_image_of_the_pinned_ray(job):
    images = {pod["containers"][0]["image"] for _, pod in _pods(job)}
    assert len(images) == 1, f"one image for head and workers (Ray versions must match): {images}"
    assert _ray_pin() in images.pop()


def test_every_selector_of_the_nodes_section_is_met_by_a_worker_group(job, cfg):
    groups = _groups(job)
    for sel in bundle_selectors(cfg):
        if sel:
            assert any(matches(sel, g["labels"]) for g in groups), f"no worker group's labels match {sel}"


def test_the_worker_groups_hold_every_bundle_of_the_placement_group(job, cfg):
    """First fit, in bundle order, onto one node per replica: a bundle (a TP engine's GPUs included) sits on one node
    whose labels match its selector; GPUs asked for outside the bundles must fit in what is left."""
    free = [(g["labels"], int(str(g["template"]["spec"]["containers"][0]["resources"]["limits"][GPU])))
            for g in _groups(job) for _ in range(g["replicas"])]
    free = [list(n) for n in free]
    for i, (sel, gpus) in enumerate(zip(bundle_selectors(cfg), slot_gpus(cfg))):
        node = next((n for n in free if matches(sel, n[0]) and n[1] >= gpus), None)
        assert node is not None, f"bundle {i} ({gpus} GPUs, labels {sel}) fits no worker node left"
        node[1] -= gpus
    assert sum(outside_gpus(cfg).values()) <= sum(n[1] for n in free)


def test_the_shared_volume_is_mounted_at_output_dirs_parent_in_every_pod(docs, job):
    output_dir = _output_dir(*_entrypoint(job))
    assert PurePosixPath(output_dir).is_absolute(), f"experiment.output_dir {output_dir!r}: relative in a Ray job"
    mounts, claims = set(), set()
    for who, pod in _pods(job):
        pvcs = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
                if "persistentVolumeClaim" in v}
        for container in pod["containers"]:
            shared = [m for m in container.get("volumeMounts", []) if m["name"] in pvcs]
            assert len(shared) == 1, f"{who}: {container['name']} mounts the shared volume once"
            mounts.add(shared[0]["mountPath"])
            claims.add(pvcs[shared[0]["name"]])
    assert mounts == {str(PurePosixPath(output_dir).parent)}, (mounts, output_dir)
    assert len(claims) == 1, claims
    pvc = [d for d in docs if d.get("kind") == "PersistentVolumeClaim" and d["metadata"]["name"] in claims]
    assert all("ReadWriteMany" in d["spec"]["accessModes"] for d in pvc), "every node writes the run folder"
