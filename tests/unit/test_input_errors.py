"""Bad paths get one clear line before any actor starts: the run name, the model folder, the output folder."""
import pytest
import yaml

from rlhf_orch.config.loader import load_config
from rlhf_orch.errors import ConfigError


def _error(tmp_path, *overrides) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"engines": [{"kind": "hf"}], "experiment": {"output_dir": str(tmp_path / "runs")}}))
    with pytest.raises(ConfigError) as e:
        load_config(str(path), list(overrides))
    return str(e.value)


@pytest.mark.parametrize("name", ["../x", "a/b", ".."])
def test_run_name_must_be_a_plain_folder_name(tmp_path, name):
    assert "experiment.name: not a plain folder name" in _error(tmp_path, f"experiment.name={name}")


def test_model_path_must_be_a_local_model_folder(tmp_path):
    assert "model.path: not a local folder (rlhf_orch does not download models)" in _error(tmp_path, "model.path=Qwen/Qwen3-8B")
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in _error(tmp_path, f"model.path={tmp_path / 'empty'}")


def test_output_dir_must_be_writable(tmp_path):
    (tmp_path / "file").write_text("x")
    msg = _error(tmp_path, f"experiment.output_dir={tmp_path / 'file' / 'runs'}")
    assert "experiment.output_dir: cannot write to" in msg and "Not a directory" in msg
