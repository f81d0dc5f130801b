"""Write the bring-your-own-data example that visibly learns on CPU: examples/sums/{train,test}.parquet.

    python examples/make_sums_parquet.py          # needs pip install -e ".[data]"; deterministic

The task is the CPU default's (single-digit sums, operands 0..4: 25 problems), written the way verl writes a
dataset, so the run goes through the whole bring-your-own-data path: parquet read with `datasets`, chat-message
prompts rendered with a chat template file, the answer taken from a nested column, an evaluation split.
    prompt        [{"role": "user", "content": "3+4="}]
    reward_model  {"style": "rule", "ground_truth": "7"}
    extra_info    {"split", "index"}
train.parquet holds the 25 problems; test.parquet holds the same 25: with 25 problems there is nothing to hold
out, so the evaluation measures what the policy answers greedily on the problems it trains on (the tiny model
learns a table, not addition). configs/sums_cpu.yaml trains on it; configs/gsm8k_cpu.yaml is the recipe for word
problems and a real model.
"""
from __future__ import annotations

from pathlib import Path


def rows(split: str, max_operand: int = 4) -> list[dict]:
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    return [{"data_source": "rlhf_orch/sums", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": split, "index": i}} for i, (a, b) in enumerate(pairs)]


def main(out_dir: Path = Path(__file__).resolve().parent / "sums") -> None:
    import datasets   # as verl writes it: Dataset.to_parquet

    out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        data = rows(split)
        datasets.Dataset.from_list(data).to_parquet(str(out_dir / f"{split}.parquet"))
        print(f"wrote {len(data)} rows to {out_dir / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
