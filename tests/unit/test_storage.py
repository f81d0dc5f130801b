"""rlhf_orch/storage.py against pyarrow's local filesystem through file:// URIs (the code path of s3:// and gs://):
trees up and down with digests, single files whole or not at all, listing and removal, and the local mirror's name."""
import hashlib

import pytest

from rlhf_orch.errors import ConfigError
from rlhf_orch.storage import Store, is_uri, local_mirror, run_uri


def test_uri_detection_and_the_mirror_folder(monkeypatch, tmp_path):
    assert is_uri("s3://bucket/runs") and is_uri("file:///tmp/x") and is_uri("gs://b")
    assert not is_uri("runs") and not is_uri("/abs/runs") and not is_uri(None) and not is_uri("c:/x")
    monkeypatch.setenv("RLHF_ORCH_LOCAL_RUNS", str(tmp_path))
    assert local_mirror("s3://bucket/runs/") == str(tmp_path / "s3_bucket_runs")
    assert run_uri("s3://b/runs/", "x") == "s3://b/runs/x"
    assert run_uri("s3://b/runs?endpoint_override=127.0.0.1:9000&scheme=http", "x") == \
        "s3://b/runs/x?endpoint_override=127.0.0.1:9000&scheme=http"


def test_trees_and_files_round_trip(tmp_path):
    src = tmp_path / "src"
    (src / "hf").mkdir(parents=True)
    (src / "a.pt").write_bytes(b"x" * 1000)
    (src / "hf" / "model.safetensors").write_bytes(b"y" * 10)
    (src / ".run.lock").write_text("")
    store = Store(f"file://{tmp_path}/bucket/run")
    store.check_writable()
    up = store.put_tree(src, "checkpoints/step2", skip=(".run.lock",))
    assert up == {"a.pt": [1000, hashlib.sha256(b"x" * 1000).hexdigest()],
                  "hf/model.safetensors": [10, hashlib.sha256(b"y" * 10).hexdigest()]}
    assert store.dirs("checkpoints") == ["step2"] and store.dirs("nothing") == []
    dest = tmp_path / "node2" / "step2"
    assert store.get_tree("checkpoints/step2", dest) == 1010
    assert (dest / "hf" / "model.safetensors").read_bytes() == b"y" * 10 and not (dest / ".run.lock").exists()
    assert store.get_tree("checkpoints/step2", dest) == 0        # already there: nothing fetched again
    assert store.get_tree("checkpoints/step9", tmp_path / "none") == 0
    store.write("checkpoints/latest", b"step2\n")
    assert store.read("checkpoints/latest") == b"step2\n" and store.read("missing") is None
    assert store.get_file("checkpoints/latest", tmp_path / "l") and (tmp_path / "l").read_text() == "step2\n"
    assert not store.get_file("missing", tmp_path / "m") and not (tmp_path / "m").exists()
    store.remove("checkpoints/step2")
    assert store.dirs("checkpoints") == []


def test_an_unknown_scheme_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="experiment.storage_uri: cannot open 'nosuch://x'"):
        Store("nosuch://x")
