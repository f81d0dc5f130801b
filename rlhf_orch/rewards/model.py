"""Score responses with a learned reward model: an AutoModelForSequenceClassification with one label.

The score of a sample is the reward model's logit at the last non-pad token of `prompt + response` (the text
the policy saw and wrote, concatenated as plain text, no chat template), tokenised with the reward model's own
tokenizer: the pooling OpenRLHF's and verl's reward models use. Batches are padded by this module, and the
positions of every sequence restart at 0 at its first real token, so a score does not depend on the padding
side, on the other sequences in its batch or on the batch size (up to float rounding, ~1e-6 in float32).
The model runs forward-only, in eval mode under `torch.inference_mode`, on cpu or cuda.

For decoder-only classifiers (Llama, Qwen, Mistral, ... : a `score` head on `base_model_prefix`) the pooling
is done here from the attention mask. Other architectures (an encoder with its own pooler) fall back to the
model's own pooled logit.

It does not combine the score with a rule-based reward (scorer.py does) and knows nothing of Ray.
`reward_model_problem` checks a folder before anything loads it (the config validator calls it).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

from rlhf_orch.errors import RewardError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def reward_model_problem(path: str) -> str | None:
    """What is wrong with `path` as a reward-model folder, in one sentence with the fix; None if nothing.

    Reads config.json with AutoConfig (no weights are loaded). The message does not repeat the path."""
    p = Path(path)
    if not p.exists():
        return "folder not found; give a local Hugging Face reward-model folder, or builtin:tiny-rm"
    if not p.is_dir() or not (p / "config.json").is_file():
        return ("not a Hugging Face model folder (no config.json); save the reward model with save_pretrained() "
                "and give its folder, or use builtin:tiny-rm")
    try:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(str(p))
    except Exception as e:   # an unknown model_type, a malformed file: a config problem, not a crash
        return f"its config.json cannot be read by AutoConfig ({type(e).__name__}: {str(e).splitlines()[0][:200]}); fix the folder"
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        return ("its config.json names no architecture, so whether it is a sequence classifier cannot be told; "
                "save it with AutoModelForSequenceClassification(num_labels=1).save_pretrained()")
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        return (f"the folder holds a {'/'.join(archs)}, not a sequence classifier (AutoModelForSequenceClassification "
                "with num_labels=1); point reward.model_path at a reward model, or use builtin:tiny-rm")
    if config.num_labels != 1:
        return (f"the classifier has num_labels={config.num_labels}; a reward model outputs one score "
                "(num_labels=1); use a reward model with a single-logit head")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        return ("the folder has no tokenizer (tokenizer.json / tokenizer_config.json); save the reward model's "
                "tokenizer into it with tokenizer.save_pretrained()")
    return None


def last_token_index(attention_mask):
    """Index of the last non-pad position of each row, for left or right padding. [B, L] -> [B]."""
    length = attention_mask.shape[1]
    return (length - 1) - attention_mask.long().flip(-1).argmax(-1)


class RewardModel:
    """A reward model loaded from a folder; `score(prompts, responses)` -> one float per pair."""

    def __init__(self, path: str, device: str = "cpu", dtype: str = "float32", batch_size: int = 16,
                 padding_side: str = "right"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        problem = reward_model_problem(path)
        if problem:
            raise RewardError(f"reward.model_path {path}: {problem}")
        self.path, self.device, self.batch_size, self.padding_side = path, device, batch_size, padding_side
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.to(device).eval().requires_grad_(False)
        cfg = self.model.config
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = cfg.pad_token_id if cfg.pad_token_id is not None else (self.tokenizer.eos_token_id or 0)
        self.pad_id = int(pad)   # only fills padded slots: masked out and never pooled, so its value does not matter
        self.max_tokens = getattr(cfg, "max_position_embeddings", None)
        self._warned_truncation = False
        self.backbone = getattr(self.model, self.model.base_model_prefix, None)
        head = getattr(self.model, "score", None)
        self.head = head if isinstance(head, torch.nn.Linear) and self.backbone is not None else None

    def encode(self, prompt: str, response: str) -> list[int]:
        ids = list(self.tokenizer(prompt + response)["input_ids"])
        if not ids:
            ids = [self.pad_id]   # an empty text still gets a score (of one token), rather than failing the step
        if self.max_tokens and len(ids) > self.max_tokens:
            if not self._warned_truncation:
                logger.warning("reward model: a prompt + response of %d tokens is longer than the model's %d "
                               "positions; its first tokens are dropped", len(ids), self.max_tokens)
                self._warned_truncation = True
            ids = ids[-self.max_tokens:]   # keep the end: the response, and the token that is scored
        return ids

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Scores of each prompt + response, computed `batch_size` at a time, in input order."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        encoded = [self.encode(p, r) for p, r in zip(prompts, responses)]
        out: list[float] = []
        for at in range(0, len(encoded), self.batch_size):
            out.extend(self._score_batch(encoded[at:at + self.batch_size]))
        for i, v in enumerate(out):
            if not math.isfinite(v):
                raise RewardError(f"reward model {self.path} scored {v} for prompt {prompts[i]!r} + response "
                                  f"{responses[i]!r}; it must give finite scores")
        return out

    def _score_batch(self, batch: list[list[int]]) -> list[float]:
        import torch

        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, ids in enumerate(batch):
            span = slice(0, len(ids)) if self.padding_side == "right" else slice(width - len(ids), width)
            input_ids[b, span] = torch.tensor(ids, dtype=torch.long)
            mask[b, span] = 1
        # Positions count real tokens only, so a left-padded sequence sees the positions it has unpadded.
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        input_ids, mask, position_ids = (t.to(self.device) for t in (input_ids, mask, position_ids))
        with torch.inference_mode():
            if self.head is not None:
                hidden = self.backbone(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
                last = last_token_index(mask)
                pooled = hidden[torch.arange(len(batch), device=hidden.device), last]
                scores = self.head(pooled)[:, 0]
            else:
                scores = self.model(input_ids=input_ids, attention_mask=mask).logits[:, 0]
        return [float(v) for v in scores.float().cpu()]
