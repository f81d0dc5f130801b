"""Where do the hf engine's logprobs and a plain forward disagree on a GPU? (tests/gpu/test_weight_sync_gpu.py's loop
tests saw rollout/logprob_diff_max 1.97 on 2x H100, 2026-11-28, with every sync's checksums equal.)

    CUDA_VISIBLE_DEVICES=0 python bench/device/hf_logprob_probe.py

The built-in tiny model (configs/tiny_gpu.yaml's shape), random prompts of the arithmetic task's lengths, the hf engine
samples 4 tokens per prompt (left-padded batch, KV cache); each sample's logprobs are recomputed by one forward of
prompt + response alone (no padding) on the same device and on the CPU. Prints the largest differences and where they
are, per attention implementation.
"""
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rlhf_orch.engines.base import SamplingParams  # noqa: E402
from rlhf_orch.engines.hf import HFEngine  # noqa: E402
from rlhf_orch.models.tiny import TinyModelSpec, ensure_model_dir  # noqa: E402


def forward_lps(model, prompt, resp, device):
    ids = torch.tensor([prompt + resp], device=device)
    logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(resp)]


def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    spec = TinyModelSpec(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = ensure_model_dir("tiny-llama", spec, tempfile.mkdtemp())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (int(torch.randint(5, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(16)]
    cpu_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for attn in ("default", "eager", "sdpa"):
        eng = HFEngine("probe", str(path), device=dev)
        if attn != "default":
            eng.model.config._attn_implementation = attn
        fwd = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(eng.device).eval()
        with torch.no_grad():
            samples = eng.generate(prompts, SamplingParams(max_new_tokens=4, n=8))
            worst = []
            for s in samples:
                same = forward_lps(fwd, s.prompt_ids, s.response_ids, eng.device)
                cpu = forward_lps(cpu_model, s.prompt_ids, s.response_ids, "cpu")
                for i, (e, a, c) in enumerate(zip(s.logprobs, same, cpu)):
                    worst.append((abs(e - a), abs(e - c), i, len(s.prompt_ids), s.response_ids[i], e, a, c))
        worst.sort(reverse=True)
        print(f"attn {attn} ({eng.model.config._attn_implementation}): max |engine - forward same device| "
              f"{worst[0][0]:.3g}, vs cpu forward {max(w[1] for w in worst):.3g}; {len(worst)} tokens")
        for w in worst[:5]:
            print("   diff %.4g cpu-diff %.4g pos %d prompt_len %d token %d engine %.4f forward %.4f cpu %.4f" % w)
        pads = sum(1 for s in samples for t in s.response_ids if t == eng.pad_id)
        print(f"   pad tokens in responses: {pads}; eos {eng.eos_id} pad {eng.pad_id}")
        del eng, fwd


if __name__ == "__main__":
    main()
