"""Write a small verl-style GSM8K parquet folder of synthetic word problems: examples/gsm8k/{train,test}.parquet.

    python examples/make_gsm8k_parquet.py          # needs pip install -e ".[data]"; deterministic (seed 0)

The columns are those verl's examples/data_preprocess/gsm8k.py writes:
    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": <question>}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "<answer>"}
    extra_info    {"split", "index", "answer" (worked solution ending in "#### <answer>"), "question"}

The questions are one-step problems with single-digit operands, written only in characters the built-in
tiny tokenizer encodes (lowercase a-z, digits, space and + - * = ( ) ? : . ,), so configs/gsm8k_cpu.yaml
trains on them with the tiny model and examples/tiny_chat_template.jinja. verl appends an instruction to
each question ('Let's think step by step and output the final answer after "####".'); it is left out here
because the tiny tokenizer has no capitals, quotes or '#'.
"""
from __future__ import annotations

import random
from pathlib import Path

NAMES = ["tom", "ann", "sam", "mia", "joe", "eva", "max", "zoe"]
THINGS = ["apples", "pens", "cards", "books", "shells", "coins"]


def problem(rng: random.Random) -> tuple[str, str, str]:
    """(question, worked solution, answer) of one random word problem."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    kind = rng.choice(["more", "less", "times"])
    if kind == "more":
        q, op, v = f"{name} has {a} {thing} and gets {b} more. how many {thing} now?", "+", a + b
    elif kind == "less":
        a, b = max(a, b), min(a, b)
        q, op, v = f"{name} has {a} {thing} and gives away {b}. how many are left?", "-", a - b
    else:
        q, op, v = f"{name} buys {a} bags of {b} {thing}. how many {thing} in all?", "*", a * b
    return q, f"{name} has {a}{op}{b}={v} {thing}.\n#### {v}", str(v)


def rows(split: str, n: int, rng: random.Random) -> list[dict]:
    out = []
    for idx in range(n):
        q, solution, answer = problem(rng)
        out.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": q}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": idx, "answer": solution, "question": q},
        })
    return out


def main(out_dir: Path = Path(__file__).resolve().parent / "gsm8k", seed: int = 0) -> None:
    import datasets   # as verl writes it: Dataset.to_parquet

    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 64), ("test", 16)):
        datasets.Dataset.from_list(rows(split, n, rng)).to_parquet(str(out_dir / f"{split}.parquet"))
        print(f"wrote {n} rows to {out_dir / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
