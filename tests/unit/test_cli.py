"""The `rlhf-orch` console command (rlhf_orch/cli.py): check and print-config on every shipped config, in this
process and without Ray; --help lists the config sections without importing anything heavy; train is launch.main."""
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from rlhf_orch import cli
from rlhf_orch.config import ExperimentConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
HEAVY = ("torch", "ray", "transformers", "deepspeed", "vllm", "sglang")


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")   # one output_dir for the module: the built-in model is built once


@pytest.fixture
def small_builtin_models(monkeypatch):
    """The built-in model at its default shape whatever the config asks (zero3_mixed_4gpu's is ~1B parameters, a
    minute and GBs to write): the tokenizer the checks use is the same for every shape."""
    from rlhf_orch import models
    from rlhf_orch.models import TinyModelSpec
    real = models.ensure_model_dir
    small = lambda name, spec, out, seed=0: real(name, TinyModelSpec(), out, seed)   # noqa: E731
    monkeypatch.setattr(models, "ensure_model_dir", small)
    # launch.py binds the name when imported: an earlier test's import must not give the check the full shape
    # (multinode_2x4gpu's 8B: ~28 GB to build, which ended the whole unit run by the OOM killer).
    sys.path.insert(0, str(ROOT))
    import launch   # here, not at the top: the module's other tests check what `rlhf-orch` imports without it
    monkeypatch.setattr(launch, "ensure_model_dir", small)


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, [line for line in cap.err.splitlines() if line.startswith("error:")]


def _machine_gpus() -> int:
    import torch
    return torch.cuda.device_count()


# ---- check / print-config on every shipped config --------------------------------------------------------------------

@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_check_passes_on_every_shipped_config(capsys, out_dir, small_builtin_models, path):
    import ray
    argv = ["check", "--config", str(path), f"experiment.output_dir={out_dir}"]
    cfg = load_config(path, [f"experiment.output_dir={out_dir}"])
    rc, out, err = run_cli(capsys, *argv)
    if cfg.trainer.device == "cuda" and _machine_gpus() == 0:
        # A GPU config on a machine without GPUs: the local-fit check says so, in one line, before Ray ...
        assert rc == 2 and len(err) == 1 and "but this machine (0 GPUs" in err[0] and "ray.address" in err[0], err
        assert out == ""
        # ... and with a cluster to join (checked once joined) every other check passes here.
        rc, out, err = run_cli(capsys, *argv, "ray.address=127.0.0.1:6379")
    assert rc == 0 and err == [], err
    assert not ray.is_initialized(), "check must not start Ray"
    *config_lines, last = out.splitlines()
    assert last.startswith("ok: every check before Ray passed; the run would write to ")
    assert last.endswith(f"{out_dir}/{cfg.experiment.name}")
    shown = yaml.safe_load("\n".join(config_lines))
    assert shown["experiment"]["name"] == cfg.experiment.name and len(shown["engines"]) == len(cfg.engines)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_print_config_shows_the_resolved_config_that_loads_back(capsys, tmp_path, out_dir, path):
    rc, out, err = run_cli(capsys, "print-config", "--config", str(path), f"experiment.output_dir={out_dir}")
    assert rc == 0 and err == []
    shown = yaml.safe_load(out)
    assert list(shown)[:3] == ["resume", "experiment", "ray"]        # the schema's order, every section
    assert "lr" in shown["trainer"] and "get_timeout_s" in shown["ray"]   # defaults included, not only the file's
    again = tmp_path / "resolved.yaml"
    again.write_text(out)
    cfg = load_config(path, [f"experiment.output_dir={out_dir}"])
    assert load_config(again).model_dump() == cfg.model_dump()      # `print-config > x.yaml` is a config that runs


def test_print_config_applies_the_overrides(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(4)))
    rc, out, _ = run_cli(capsys, "print-config", "--config", str(ROOT / "configs/tiny_cpu.yaml"),
                         f"experiment.output_dir={tmp_path}", f"data.source={data}", "~data.max_operand",
                         "data.prompts_per_step=2", "metrics.trackers=jsonl", "trainer.lr=0.5")
    shown = yaml.safe_load(out)
    assert rc == 0 and shown["data"]["source"] == str(data) and "max_operand" not in shown["data"]
    assert shown["metrics"]["trackers"] == ["jsonl"] and shown["trainer"]["lr"] == 0.5


# ---- bad input -------------------------------------------------------------------------------------------------------

def test_check_on_bad_input_is_one_error_and_exit_2(capsys, tmp_path):
    import ray
    rc, out, err = run_cli(capsys, "check", "--config", str(ROOT / "configs/tiny_cpu.yaml"),
                           f"experiment.output_dir={tmp_path}", "trainer.lrr=1")
    assert rc == 2 and out == "" and len(err) == 1 and not ray.is_initialized()
    assert err[0].startswith("error: trainer.lrr: unknown key; did you mean 'lr'?")


def test_check_refuses_blank_prompts_before_ray(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "  ", "answer": "4"}\n')
    rc, out, err = run_cli(capsys, "check", "--config", str(ROOT / "configs/tiny_cpu.yaml"),
                           f"experiment.output_dir={tmp_path}", f"data.source={data}", "~data.max_operand",
                           "data.prompts_per_step=1")
    assert rc == 2 and out == ""
    assert err == [f"error: {data}:2: 'prompt' is only whitespace ('  '); give the row a prompt with text, or remove the row"]


def test_check_reports_a_run_folder_a_fresh_run_would_refuse(capsys, tmp_path):
    (tmp_path / "tiny_cpu").mkdir()
    (tmp_path / "tiny_cpu" / "metrics.jsonl").write_text("{}\n")
    argv = ["check", "--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}"]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: experiment.name: run folder")
    rc, _, err = run_cli(capsys, *argv, "experiment.overwrite=true")   # train would delete them: check does not
    assert rc == 0 and (tmp_path / "tiny_cpu" / "metrics.jsonl").exists()


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["bogus"], ["check"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2


# ---- train, arguments, --help ----------------------------------------------------------------------------------------

def test_train_is_launch_main_with_the_same_arguments(monkeypatch, tmp_path):
    sys.path.insert(0, str(ROOT))
    import launch
    seen = []
    monkeypatch.setattr(launch, "main", lambda argv: seen.append(argv) or 7)
    # the overrides may come before --config, after it, or both
    assert cli.main(["train", "a.b=1", "--config", "x.yaml", "~c.d", "metrics.trackers=jsonl"]) == 7
    assert seen == [["--config", "x.yaml", "a.b=1", "~c.d", "metrics.trackers=jsonl"]]


def test_help_lists_every_section_with_its_description(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for sub in ("train", "check", "print-config"):
        assert sub in out
    for name, field in ExperimentConfig.model_fields.items():
        assert f"  {name} " in out and field.description.splitlines()[0] in out, name


def test_launch_help_lists_the_sections_too(capsys):
    sys.path.insert(0, str(ROOT))
    import launch
    with pytest.raises(SystemExit) as e:
        launch.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--config" in out and "~section.key" in out and "  fault_tolerance " in out


def test_help_imports_nothing_heavy():
    code = ("import sys, io, contextlib\nfrom rlhf_orch import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: cli.main(['--help'])\n    except SystemExit: pass\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert got.returncode == 0 and got.stdout.strip() == "[]", got.stderr


def test_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"rlhf-orch": "rlhf_orch.cli:main"}


def test_importing_launch_brings_in_nothing_heavy():
    """launch.py's top-level imports stay light (its comment says why: `--help` and config errors come at once); a
    library module whose package pulls torch in belongs inside the function that needs it."""
    code = f"import sys; sys.path.insert(0, '.'); import launch; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
