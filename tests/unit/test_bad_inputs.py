"""Every bad input of issue 15 item 9, through launch.main(): exit code 2 and one `error:` line naming the field and
the fix, before Ray starts (the per-field checks themselves are also tested in test_config.py, test_input_errors.py
and test_hf_datasets.py)."""
import json
import socket
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import launch  # noqa: E402
from rlhf_orch.config import load_config  # noqa: E402
from rlhf_orch.resources import local_fit_problem  # noqa: E402

BASE = "engines: [{kind: hf}]\ntrainer: {num_ranks: 1}\n"


def one_error(capsys, tmp_path, *overrides, yaml_text=BASE) -> str:
    import ray
    p = tmp_path / "c.yaml"
    p.write_text(yaml_text)
    t0 = time.time()
    rc = launch.main(["--config", str(p), f"experiment.output_dir={tmp_path / 'runs'}", *overrides])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert not ray.is_initialized(), "no actor may start on bad input"
    assert rc == 2 and len(err) == 1, err
    assert time.time() - t0 < 60   # seconds, not a placement-group timeout
    return err[0].removeprefix("error: ")


def rows_file(tmp_path, rows, name="d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dataset_not_utf8(capsys, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "x"}\n')
    msg = one_error(capsys, tmp_path, f"data.source={path}", "data.prompts_per_step=1")
    assert msg.startswith(f"data.source: {path} is not UTF-8 text (byte 0xe9 on line 2)") and "iconv" in msg


@pytest.mark.parametrize("path", ["Qwen/Qwen3-8B", "/no/such/model"])
def test_model_folder_that_does_not_exist_is_not_downloaded(capsys, tmp_path, monkeypatch, path):
    tried = []
    monkeypatch.setattr(socket.socket, "connect", lambda self, addr: tried.append(addr))
    monkeypatch.setattr(socket, "create_connection", lambda addr, *a, **k: tried.append(addr))
    msg = one_error(capsys, tmp_path, f"model.path={path}")
    assert msg.startswith("model.path: not a local folder (rlhf_orch does not download models)")
    assert "Hugging Face model folder (config.json, weights, tokenizer) or builtin:tiny-llama" in msg
    assert tried == []


def test_output_dir_that_cannot_be_written(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    msg = one_error(capsys, tmp_path, f"experiment.output_dir={tmp_path / 'file' / 'runs'}")
    assert msg.startswith("experiment.output_dir: cannot write to") and "choose a folder you can write to" in msg


def test_ray_num_cpus_below_one(capsys, tmp_path):
    msg = one_error(capsys, tmp_path, "ray.num_cpus=0.5")
    assert msg.startswith("ray.num_cpus: 0.5 is below 1") and "set ray.num_cpus >= 1" in msg


def test_ray_num_cpus_with_a_cluster_address(capsys, tmp_path):
    msg = one_error(capsys, tmp_path, "ray.num_cpus=2", "ray.address=127.0.0.1:6379")
    assert msg.startswith("ray.num_cpus: sizes a local Ray only") and "remove it" in msg


def test_more_cpu_slots_than_the_local_ray_has(capsys, tmp_path):
    # 20 ranks + 1 dedicated engine at a quarter CPU each: 5.25 CPUs asked of a local Ray of 2
    msg = one_error(capsys, tmp_path, "trainer.num_ranks=20", "ray.num_cpus=2")
    assert msg.startswith("trainer.num_ranks: the run needs 5.25 CPUs (trainer.num_ranks 20 + 1 dedicated engine")
    assert "but the local Ray (ray.num_cpus 2) has 2" in msg and "raise ray.num_cpus" in msg


def test_more_gpus_than_this_machine_has(capsys, tmp_path):
    import torch
    have = torch.cuda.device_count()
    msg = one_error(capsys, tmp_path, "trainer.device=cuda", f"trainer.num_ranks={have + 1}", "ray.num_cpus=64")
    assert msg.startswith(f"trainer.num_ranks: the run needs {have + 2} GPUs (trainer.num_ranks {have + 1} + "
                          "1 dedicated engine") and f"but this machine ({have} GPUs, 64 CPUs) has {have}" in msg
    assert "placement: colocated" in msg


def test_every_shipped_cpu_config_fits_two_cpus():
    for path in sorted((ROOT / "configs").glob("*cpu*.yaml")):
        cfg = load_config(path, ["ray.num_cpus=2"])
        assert local_fit_problem(cfg, environ={}) is None, path


@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce_pp"])
def test_group_size_one_with_a_group_algorithm(capsys, tmp_path, algo):
    msg = one_error(capsys, tmp_path, f"algorithm.name={algo}", "algorithm.group_size=1")
    assert msg.startswith(f"algorithm.group_size: {algo} compares the samples of one prompt") and "group_size >= 2" in msg


@pytest.mark.parametrize("name", ["../x", "a/b", ".."])
def test_run_name_with_a_path_separator(capsys, tmp_path, name):
    msg = one_error(capsys, tmp_path, f"experiment.name={name}")
    assert msg.startswith("experiment.name: not a plain folder name") and "experiment.output_dir" in msg


def test_prompts_per_step_larger_than_the_dataset(capsys, tmp_path):
    path = rows_file(tmp_path, [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)])
    msg = one_error(capsys, tmp_path, f"data.source={path}", "data.prompts_per_step=4")
    assert msg == (f"data.prompts_per_step: 4 prompts per step but {path} has 3 rows, so a step would repeat prompts; "
                   "set data.prompts_per_step to at most 3 or add rows")


def test_max_operand_with_a_file_source(capsys, tmp_path):
    path = rows_file(tmp_path, [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)])
    msg = one_error(capsys, tmp_path, f"data.source={path}", "data.prompts_per_step=3", "data.max_operand=4")
    assert msg == f"data.max_operand: applies to builtin:arithmetic only and data.source is the file {str(path)!r}; remove it"


@pytest.mark.parametrize("override, field, needs", [
    ("algorithm.gamma=0.9", "algorithm.gamma", "algorithm.name: ppo or reinforce_pp_gamma"),
    ("algorithm.norm_adv_by_std=false", "algorithm.norm_adv_by_std", "algorithm.name: grpo"),
    ("algorithm.tis_cap=3", "algorithm.tis_cap", "algorithm.off_policy: tis"),
    ("critic.lr=0.01", "critic.lr", "algorithm.name: ppo"),
])
def test_options_that_do_not_apply_to_the_algorithm(capsys, tmp_path, override, field, needs):
    name = ["algorithm.name=rloo"] if "norm_adv" in override else []
    msg = one_error(capsys, tmp_path, *name, override)
    assert msg.startswith(f"{field}: ") and f"remove it or set {needs}" in msg


def test_options_that_apply_are_accepted(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(BASE)
    load_config(p, ["algorithm.name=ppo", "algorithm.gamma=0.9", "algorithm.lam=0.95", "critic.lr=0.01"])
    load_config(p, ["algorithm.off_policy=tis", "algorithm.tis_cap=3", "algorithm.norm_adv_by_std=false"])


@pytest.mark.parametrize("rows, start", [
    ([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}], ":2: row has no 'answer'"),
    ([{"prompt": "1+1="}, {"prompt": "2+2="}], "data.answer_key: 'answer' is in no row of"),
])
def test_warm_start_on_rows_without_an_answer(capsys, tmp_path, rows, start):
    path = rows_file(tmp_path, rows)
    msg = one_error(capsys, tmp_path, f"data.source={path}", "data.prompts_per_step=2", "trainer.warm_start_steps=3",
                    "reward.function=null", "reward.model_path=builtin:tiny-rm")   # a reward that needs no answer
    assert start in msg and "trainer.warm_start_steps trains on rows' answers, even on the format only" in msg
    assert "or set trainer.warm_start_steps: 0" in msg


def test_characters_the_builtin_tokenizer_cannot_encode(capsys, tmp_path):
    path = rows_file(tmp_path, [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    msg = one_error(capsys, tmp_path, f"data.source={path}", "data.prompts_per_step=2")
    assert msg.startswith(f"data.prompt_key: 1 prompts of {path} hold characters the tokenizer cannot encode "
                          "('W'; first: row 0), which would silently become <unk>")
    assert "the built-in tokenizer knows only lowercase" in msg


# ---- an algorithm whose required role cannot work as configured (issue 14) -----------------------------------------
def _reward_model_folder(tmp_path) -> Path:
    from rlhf_orch.models import TinyModelSpec
    from rlhf_orch.models.reward_tiny import ensure_reward_model_dir
    return ensure_reward_model_dir(TinyModelSpec(), tmp_path / "models", seed=0)


@pytest.mark.parametrize("where, start", [
    ("missing", "is not a local folder (rlhf_orch does not download models)"),
    ("builtin", "'builtin:tiny-llama': built-in models are built for model.path only"),
    ("no_config", "has no config.json, so it is not a Hugging Face model folder"),
    ("classifier", "the folder holds a LlamaForSequenceClassification, not a causal LM (AutoModelForCausalLM)"),
])
def test_critic_model_path_that_is_not_a_causal_lm_folder(capsys, tmp_path, where, start):
    path = {"missing": str(tmp_path / "nope"), "builtin": "builtin:tiny-llama", "no_config": str(tmp_path),
            "classifier": str(_reward_model_folder(tmp_path)) if where == "classifier" else ""}[where]
    msg = one_error(capsys, tmp_path, "algorithm.name=ppo", f"critic.model_path={path}")
    assert msg.startswith("critic.model_path: ") and start in msg, msg
    assert "remove critic.model_path to start the critic from model.path" in msg, msg   # the fix


@pytest.mark.parametrize("overrides, start", [
    (["reward.function_weight=0"], "reward.function_weight: 0 and no reward.model_path, so every reward would be 0"),
    (["reward.function=null"], "reward.model_path: no reward source: reward.function is null and reward.model_path"),
    (["reward.function=null", "reward.model_path=builtin:tiny-rm", "reward.model_weight=0"],
     "reward.model_weight: 0 and reward.function is null, so every reward would be 0"),
])
def test_ppo_without_a_reward_source(capsys, tmp_path, overrides, start):
    msg = one_error(capsys, tmp_path, "algorithm.name=ppo", *overrides)
    assert msg.startswith(start), msg
    assert "set reward." in msg


@pytest.mark.parametrize("overrides, start, fix", [
    (["reference.placement=separate", "reference.num_workers=2"],
     "reference.num_workers: 2 workers but a step has only trainer.num_ranks = 1 shards", "set it to at most 1"),
    (["reference.num_workers=2"], "reference.num_workers: applies to reference.placement: separate only",
     "remove it or set reference.placement: separate"),
])
def test_kl_reference_that_its_settings_make_unusable(capsys, tmp_path, overrides, start, fix):
    msg = one_error(capsys, tmp_path, "algorithm.name=ppo", "algorithm.kl_coef=0.05", *overrides)
    assert msg.startswith(start) and fix in msg, msg


@pytest.mark.parametrize("overrides, start, fix", [
    (["trainer.num_ranks=2", "critic.placement=separate", "critic.num_ranks=3"],
     "critic.num_ranks: 3 critic ranks cannot share trainer.num_ranks = 2 policy shards evenly", "use one of [1, 2]"),
    (["critic.num_ranks=2"], "critic.num_ranks: applies to critic.placement: separate only",
     "remove it or set critic.placement: separate"),
    (["trainer.offload=true", "critic.zero_stage=0"], "critic.zero_stage: a colocated critic leaves the GPU with the "
     "policy (trainer.offload), which needs a ZeRO optimizer", "set critic.zero_stage to 1, 2 or 3"),
])
def test_critic_placement_that_cannot_work(capsys, tmp_path, overrides, start, fix):
    msg = one_error(capsys, tmp_path, "algorithm.name=ppo", *overrides)
    assert msg.startswith(start) and fix in msg, msg


def test_a_separate_critic_counts_its_gpus(capsys, tmp_path):
    import torch
    have = torch.cuda.device_count()
    msg = one_error(capsys, tmp_path, "algorithm.name=ppo", "trainer.device=cuda", "critic.placement=separate",
                    f"critic.num_ranks={have + 1}", f"trainer.num_ranks={have + 1}", "ray.num_cpus=64")
    assert msg.startswith(f"trainer.num_ranks: the run needs {2 * have + 3} GPUs (trainer.num_ranks {have + 1} + "
                          f"1 dedicated engine + {have + 1} (critic.num_ranks)"), msg


def test_critic_and_reference_halves_share_one_gpu():
    from rlhf_orch.resources import fit_problem
    cfg = load_config(ROOT / "configs/ppo_2gpu.yaml", [])
    assert fit_problem(cfg, 16, 2, "two GPUs") is None   # policy + engine on one, critic and reference halves on the other
    msg = fit_problem(cfg, 16, 1, "one GPU")
    assert msg.startswith("trainer.num_ranks: the run needs 2 GPUs") and "+ 0.5 (critic.num_ranks)" in msg, msg
    whole = load_config(ROOT / "configs/ppo_2gpu.yaml", ["critic.gpus_per_rank=1"])
    assert "needs 2.5 GPUs" in fit_problem(whole, 16, 2, "two GPUs")


def test_a_gpu_share_for_a_colocated_critic_is_refused(capsys, tmp_path):
    msg = one_error(capsys, tmp_path, "algorithm.name=ppo", "critic.gpus_per_rank=0.5")
    assert msg.startswith("critic.gpus_per_rank: applies to critic.placement: separate only"), msg
