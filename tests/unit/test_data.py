"""Datasets: row validation by line, the resumable cursor, and the synthetic tasks."""
import json

import pytest

from rlhf_orch.data import PromptDataset, arithmetic_rows, load_rows
from rlhf_orch.errors import DataError
from rlhf_orch.models import build_tokenizer


def test_arithmetic_rows_are_correct():
    rows = arithmetic_rows(4)
    assert len(rows) == 25
    for r in rows:
        a, b = r["prompt"].rstrip("=").split("+")
        assert int(r["answer"]) == int(a) + int(b)


def test_row_without_prompt_is_named_by_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"question": "x"}) + "\n{bad\n")
    with pytest.raises(DataError) as e:
        load_rows(str(p))
    lines = str(e.value).splitlines()
    assert lines[0] == f"{p}:2: row has no 'prompt' field (keys: question); add \"prompt\": \"...\""
    assert lines[1].startswith(f"{p}:3: not valid JSON")


def test_missing_file_and_unknown_builtin():
    with pytest.raises(DataError, match="not found"):
        load_rows("/no/such.jsonl")
    with pytest.raises(DataError, match="unknown built-in task 'nope'"):
        load_rows("builtin:nope")


def test_cursor_resumes_the_same_order():
    tok = build_tokenizer()
    rows = arithmetic_rows(4)
    a = PromptDataset(rows, tok, 32, seed=3)
    a.next_batch(10)
    state = a.state()
    expected = [p.text for p in a.next_batch(30)]   # crosses an epoch boundary (25 rows)
    b = PromptDataset(rows, tok, 32, seed=3)
    b.restore(state)
    assert [p.text for p in b.next_batch(30)] == expected
    assert [p.index for p in b.next_batch(4)] == [0, 1, 2, 3]


def test_every_row_appears_once_per_epoch():
    tok = build_tokenizer()
    ds = PromptDataset(arithmetic_rows(4), tok, 32, seed=0)
    assert sorted(p.text for p in ds.next_batch(25)) == sorted(r["prompt"] for r in arithmetic_rows(4))


def test_prompt_too_long_is_rejected():
    with pytest.raises(DataError, match="data.max_prompt_tokens"):
        PromptDataset([{"prompt": "123456789"}], build_tokenizer(), 4)
