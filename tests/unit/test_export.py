"""HF exports that load: a DeepSpeed rank (one rank on gloo, ZeRO-2 and ZeRO-3) takes a step and exports; the
folder loads with AutoModelForCausalLM and AutoTokenizer, carries the run's chat template and generation
defaults, its logits equal the trainer's to 1e-6 in float32, and it generates. export_spec reads a run's config;
the tokenizer's own template and a base model's eos list survive an export."""
import json
import socket
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "tiny_chat_template.jinja"


def _sft_batch(tokenizer, n: int = 6):
    from rlhf_orch.trainer import build_sft_batch
    g = torch.Generator().manual_seed(0)
    prompts = [tokenizer(f"{i}+{i + 1}=", add_special_tokens=False).input_ids for i in range(n)]
    answers = [torch.randint(4, len(tokenizer), (3,), generator=g).tolist() for _ in range(n)]
    return build_sft_batch(prompts, answers, tokenizer.pad_token_id)


def _train_and_export(model_dir: str, zero_stage: int, out: str, spec, ids: torch.Tensor, result: str,
                      device: str = "cpu") -> None:
    """In a fresh process (DeepSpeed keeps process-group state that a second trainer in one process trips on):
    one rank takes a supervised step, exports, and saves its own logits on `ids` to `result` (also used by
    tests/gpu/test_export_vllm.py with device cuda)."""
    import os
    from transformers import AutoTokenizer
    from rlhf_orch.trainer.deepspeed_trainer import DeepSpeedTrainer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0")
    tr = DeepSpeedTrainer(model_dir, 0, 1, device=device, zero_stage=zero_stage, lr=1e-2)
    try:
        batch = _sft_batch(AutoTokenizer.from_pretrained(model_dir))
        tr.sft_step(batch, float(batch.response_mask.sum()))   # the export must be the trained policy
        tr.export_hf(out, spec)
        with torch.no_grad():
            torch.save(tr.engine.module(input_ids=ids.to(tr.device)).logits.cpu(), result)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_export_loads_generates_and_equals_the_trainer(tmp_path, tiny_model_dir, zero_stage):
    import multiprocessing
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from rlhf_orch.trainer.export import ExportSpec

    source_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = TEMPLATE.read_text(encoding="utf-8")
    spec = ExportSpec(tokenizer_path=tiny_model_dir, chat_template=template, temperature=0.7, top_p=0.9, max_new_tokens=6)
    prompt = source_tok.apply_chat_template([{"role": "user", "content": "what is 2+3?"}], tokenize=False,
                                            add_generation_prompt=True, chat_template=template)
    ids = torch.tensor([source_tok(prompt, add_special_tokens=False).input_ids])
    out = tmp_path / "hf"
    proc = multiprocessing.get_context("spawn").Process(
        target=_train_and_export, args=(tiny_model_dir, zero_stage, str(out), spec, ids, str(tmp_path / "logits.pt")))
    proc.start()
    proc.join(600)
    assert proc.exitcode == 0, f"the trainer process exited with {proc.exitcode} (its traceback is in the captured stderr)"
    trainer_logits = torch.load(tmp_path / "logits.pt")

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names, names
    start, exported = load_file(str(Path(tiny_model_dir) / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert exported.keys() == start.keys() and any(not torch.equal(exported[k], start[k]) for k in start)

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == template
    assert tok.apply_chat_template([{"role": "user", "content": "what is 2+3?"}], tokenize=False,
                                   add_generation_prompt=True) == prompt
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(tok, attr) == getattr(source_tok, attr) is not None, attr
    assert tok(prompt, add_special_tokens=False).input_ids == ids[0].tolist()

    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        source_tok.bos_token_id, source_tok.eos_token_id, source_tok.pad_token_id)
    assert gen.do_sample and (gen.temperature, gen.top_p, gen.max_new_tokens) == (0.7, 0.9, 6)
    assert model.generation_config.max_new_tokens == 6 and model.generation_config.temperature == 0.7

    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert (logits - trainer_logits).abs().max() <= 1e-6
    torch.manual_seed(0)
    sampled = model.generate(ids, attention_mask=torch.ones_like(ids))   # the exported defaults: sample, <= 6 new
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False)
    for seq in (sampled, greedy):
        new = seq[0, ids.shape[1]:].tolist()
        assert 1 <= len(new) <= 6 and (len(new) == 6 or new[-1] == tok.eos_token_id)
    first = int(logits[0, -1].argmax())
    assert int(greedy[0, ids.shape[1]]) == first


def test_export_spec_reads_the_runs_template_and_first_engines_sampling(monkeypatch, tiny_model_dir):
    from rlhf_orch.config import load_config
    from rlhf_orch.trainer.export import export_spec
    pytest.importorskip("datasets")
    monkeypatch.chdir(ROOT)   # the config's paths are relative to the repository root
    cfg = load_config("configs/gsm8k_cpu.yaml", ["engines.0.sampling.temperature=0.6", "engines.0.sampling.top_p=0.8",
                                                 "engines.1.sampling.temperature=0.6", "engines.1.sampling.top_p=0.5"])
    spec = export_spec(cfg, tiny_model_dir)
    assert spec.tokenizer_path == tiny_model_dir and spec.chat_template == TEMPLATE.read_text(encoding="utf-8")
    s = cfg.engines[0].sampling
    assert (spec.temperature, spec.top_p, spec.max_new_tokens) == (s.temperature, s.top_p, s.max_new_tokens) == (0.6, 0.8, 4)
    plain = load_config("configs/tiny_cpu.yaml")   # built-in prompts are plain text: the tokenizer's own template stays
    assert export_spec(plain, tiny_model_dir).chat_template is None


def test_tokenizers_own_template_and_base_eos_list_survive(tmp_path, tiny_model_dir):
    """A base folder whose tokenizer has a template and whose generation_config stops at two eos ids (a chat model's
    end-of-turn and end-of-text): the export keeps the template and the stop set, and drops the base's sampling
    defaults the run never used."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from rlhf_orch.trainer.export import ExportSpec, write_tokenizer_and_generation
    base = tmp_path / "base"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.generation_config = GenerationConfig(eos_token_id=[7, 2], bos_token_id=1, pad_token_id=0, top_k=20,
                                               do_sample=True, repetition_penalty=1.05)
    model.save_pretrained(base)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['role'] + '= ' + m['content'] }}{% endfor %}"
    tok.save_pretrained(base)

    out = tmp_path / "out"
    model = AutoModelForCausalLM.from_pretrained(base)
    model.save_pretrained(out)
    write_tokenizer_and_generation(str(out), model, ExportSpec(tokenizer_path=str(base), max_new_tokens=3))
    assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, 7] and gen["max_new_tokens"] == 3
    assert "top_k" not in gen and "repetition_penalty" not in gen


def test_export_without_a_tokenizer_names_the_folder(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from rlhf_orch.errors import TrainerError
    from rlhf_orch.trainer.export import ExportSpec, write_tokenizer_and_generation
    bare = tmp_path / "bare"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.save_pretrained(bare)   # weights and config only
    with pytest.raises(TrainerError, match="tokenizer") as err:
        write_tokenizer_and_generation(str(tmp_path / "out"), model, ExportSpec(tokenizer_path=str(bare)))
    assert str(bare) in str(err.value)
