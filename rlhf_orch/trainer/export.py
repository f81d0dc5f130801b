"""What an HF export holds beside the weights: the run's tokenizer, its chat template and generation defaults.

`checkpoints/stepN/hf/` must be a folder a user can serve as it is: `AutoModelForCausalLM.from_pretrained`,
`AutoTokenizer.from_pretrained` and vLLM load it and generate the way the run did. So next to the weights and
config.json (written by DeepSpeedTrainer._export_hf) it gets:

- the tokenizer of the model folder the run started from (tokenizer.json, tokenizer_config.json with the special
  tokens, chat_template.jinja when there is a template), written by the tokenizer's own `save_pretrained`;
- the chat template the run rendered prompts with: `data.chat_template_path`'s text when the run set one
  (it replaces the tokenizer's, as it did for every prompt), else the tokenizer's own, unchanged;
- generation_config.json: bos/eos/pad ids and the sampling defaults of the run's first engine (do_sample,
  temperature, top_p, max_new_tokens). The base model's other defaults (top_k, repetition_penalty, ...) are not
  carried over: the run never sampled with them. eos ids are the tokenizer's eos plus the base model's own eos
  ids (a list in chat models), the stop set a serving engine uses.

`ExportSpec` is made once per checkpoint on the driver (`export_spec(cfg, model_path)`: it reads the template
file where the config was loaded) and travels to the trainer ranks; rank 0 writes. Only the policy is exported:
the critic (trainer/critic.py) is a value head that no engine serves and is kept in the DeepSpeed checkpoint only.
This module neither gathers weights nor decides where or when a checkpoint is written (deepspeed_trainer.py,
driver/cluster.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from rlhf_orch.errors import TrainerError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportSpec:
    tokenizer_path: str | None = None   # folder holding the run's tokenizer (the model path); None: the trainer's model folder
    chat_template: str | None = None    # the template the run rendered with, when it is not the tokenizer's own
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None


def export_spec(cfg, model_path: str) -> ExportSpec:
    """The export settings of a run: its model folder's tokenizer, data.chat_template_path's text (file sources
    render with it), the first engine's sampling parameters."""
    path = cfg.data.chat_template_path
    template = Path(path).read_text(encoding="utf-8") if path else None
    s = cfg.engines[0].sampling
    return ExportSpec(tokenizer_path=str(model_path), chat_template=template, temperature=s.temperature,
                      top_p=s.top_p, max_new_tokens=s.max_new_tokens)


def _eos_ids(tokenizer_eos, base_eos) -> int | list[int] | None:
    ids = [tokenizer_eos] if tokenizer_eos is not None else []
    for i in base_eos if isinstance(base_eos, (list, tuple)) else [base_eos]:
        if i is not None and i not in ids:
            ids.append(int(i))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def write_tokenizer_and_generation(directory: str, model, spec: ExportSpec) -> None:
    """Into `directory` (which already holds the weights): the tokenizer with the run's chat template and
    generation_config.json. `model` is the exported module (its config and generation config give fallback ids)."""
    from transformers import AutoTokenizer, GenerationConfig

    source = spec.tokenizer_path or getattr(model, "name_or_path", None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:
        raise TrainerError(f"HF export to {directory}: cannot load the run's tokenizer from {source!r} "
                           f"({type(e).__name__}: {e}); the model folder must hold its tokenizer") from e
    if spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
    tokenizer.save_pretrained(directory)

    cfg = model.config
    base = getattr(model, "generation_config", None)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else getattr(cfg, "bos_token_id", None)
    eos = _eos_ids(tokenizer.eos_token_id, getattr(base, "eos_token_id", None) or getattr(cfg, "eos_token_id", None))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else getattr(cfg, "pad_token_id", None)
    if pad is None:   # the engines pad with eos when the tokenizer has no pad token
        pad = eos[0] if isinstance(eos, list) else eos
    gen = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, do_sample=True,
                           temperature=spec.temperature, top_p=spec.top_p, max_new_tokens=spec.max_new_tokens)
    gen.save_pretrained(directory)   # replaces the base defaults save_pretrained wrote with the run's
    logger.info("HF export %s: tokenizer from %s, %s chat template, generation defaults %s", directory, source,
                "the run's" if spec.chat_template is not None else
                ("the tokenizer's" if tokenizer.chat_template else "no"),
                {"temperature": spec.temperature, "top_p": spec.top_p, "max_new_tokens": spec.max_new_tokens})
