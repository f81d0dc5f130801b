"""GSM8K and MATH answer rewards (rlhf_orch/rewards/math.py): final-answer extraction, and equality by math-verify
(the `math` extra, installed with `dev`). No Ray."""
import sys
import threading
from pathlib import Path

import pytest

from rlhf_orch.config import load_config
from rlhf_orch.errors import ConfigError
from rlhf_orch.rewards.math import gsm8k, gsm8k_final_answer, last_boxed, last_number, math_answer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, answer", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("#### $1,234.50 in total", "1234.50"),
    ("first 12, then #### 8\n#### -3", "-3"),                  # the last ####
    ("so the answer is \\boxed{42}. (checked 3 times)", "42"),  # no ####: the box beats the last number
    ("3 boxes of 4 make 12.", "12"),                             # neither: the last number
    ("it costs .5 dollars", ".5"),
    ("####", None),                                              # declared, but no number: missing
    ("#### seven", None),
    ("no digits here", None),
    ("", None),
])
def test_gsm8k_final_answer(text, answer):
    assert gsm8k_final_answer(text) == answer


def test_last_number_drops_thousands_separators_only():
    assert last_number("from 1,000 to 2,500,000") == "2500000"
    assert last_number("pick 3, 4") == "4"   # a list, not 34
    assert last_number("none") is None


@pytest.mark.parametrize("response, value", [
    ("#### 72", 1.0),
    ("48 + 24 = 72\n#### 72", 1.0),
    ("The answer is 72.", 1.0),                 # fallback: the last number
    ("72.0", 1.0),                              # equal as numbers
    ("#### 72,000", 0.0),
    ("#### 73", 0.0),
    ("#### 72 apples? no: #### 71", 0.0),       # the last #### counts
    ("I think 72, or maybe 73", 0.0),
    ("", 0.0),
    ("no idea", 0.0),
])
def test_gsm8k_reward(response, value):
    assert gsm8k(response, {"prompt": "q", "answer": "72"}) == value


def test_gsm8k_gold_may_be_a_whole_solution():
    row = {"answer": "Natalia sold 48/2 = 24 clips in May.\nIn all 48+24 = 72 clips.\n#### 1,072"}
    assert gsm8k("#### 1072", row) == 1.0 and gsm8k("so 1,072 clips", row) == 1.0
    assert gsm8k("#### 72", row) == 0.0
    assert gsm8k("#### 5", {"answer": "no number here"}) == 0.0   # a row without an answer scores nothing


@pytest.mark.parametrize("text, inner", [
    ("\\boxed{5}", "5"),
    ("so $\\boxed{\\frac{a}{b^{2}}}$ done", "\\frac{a}{b^{2}}"),    # nested braces
    ("\\boxed{1} is wrong; \\boxed{\\sqrt{\\frac{1}{2}}}", "\\sqrt{\\frac{1}{2}}"),   # the last box
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\fbox{3}", "3"),
    ("hence \\boxed 7$.", "7"),
    ("\\boxed{7} and then \\boxed{\\frac{1}{2", None),   # the last box is cut off: the final answer is missing
    ("no box here", None),
    ("", None),
])
def test_last_boxed(text, inner):
    assert last_boxed(text) == inner


@pytest.mark.parametrize("response, value", [
    ("so $\\boxed{\\frac{1}{2}}$", 1.0),
    ("\\boxed{\\dfrac12}", 1.0),
    ("\\boxed{0.5}", 1.0),                          # numerically equal
    ("\\boxed{\\frac{2}{4}}", 1.0),                 # symbolically equal
    ("\\boxed{\\frac{1}{3}}", 0.0),
    ("\\boxed{1} first, finally \\boxed{\\frac{\\sqrt{4}}{4}}", 1.0),
    ("\\boxed{\\frac{1}{2}} then \\boxed{2}", 0.0),  # the last box is the answer
    ("the answer is 1/2", 0.0),                     # no box: no answer
    ("\\boxed{\\frac{1}{2", 0.0),
    ("", 0.0),
])
def test_math_answer(response, value):
    assert math_answer(response, {"prompt": "q", "answer": "\\frac{1}{2}"}) == value


def test_math_answer_gold_forms():
    solution = {"answer": "We get $x = \\frac{-b}{2a}$, so the vertex is at \\boxed{\\left(1, \\frac{3}{2}\\right)}."}
    assert math_answer("\\boxed{(1, 1.5)}", solution) == 1.0
    assert math_answer("\\boxed{(1, 2)}", solution) == 0.0
    assert math_answer("\\boxed{\\text{(C)}}", {"answer": "\\text{(C)}"}) == 1.0
    assert math_answer("\\boxed{\\text{(B)}}", {"answer": "\\text{(C)}"}) == 0.0
    assert math_answer("\\boxed{x^2+2x+1}", {"answer": "$(x+1)^2$"}) == 1.0
    assert math_answer("\\boxed{5}", {"answer": ""}) == 0.0


def test_works_off_the_main_thread():
    # math-verify's own timeout is signal.alarm, which raises off the main thread; the module switches it off there
    # (reward.timeout_s runs a sync function in a worker thread).
    out = []
    t = threading.Thread(target=lambda: out.append((gsm8k("#### 72", {"answer": "72"}),
                                                    math_answer("\\boxed{0.5}", {"answer": "\\frac12"}))))
    t.start()
    t.join()
    assert out == [(1.0, 1.0)]


def test_the_gsm8k_example_config_scores_its_own_rows():
    pytest.importorskip("datasets")
    from rlhf_orch.data.prepare import rows_for
    cfg = load_config(ROOT / "configs/gsm8k_cpu.yaml")
    assert cfg.reward.function == "rlhf_orch.rewards.math:gsm8k"
    rows = rows_for(cfg)
    assert all(gsm8k(r["answer"], r) == 1.0 and gsm8k(f"#### {r['answer']}", r) == 1.0 for r in rows)
    assert all(gsm8k(str(int(r["answer"]) + 1), r) == 0.0 for r in rows)


def test_without_math_verify_the_config_fails_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)          # import math_verify now raises ImportError
    monkeypatch.delitem(sys.modules, "rlhf_orch.rewards.math")     # so the module is imported again
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny_cpu.yaml", ["reward.function=rlhf_orch.rewards.math:math_answer"])
    (line,) = e.value.problems
    assert line.startswith("reward.function: cannot import module 'rlhf_orch.rewards.math'")
    assert "math-verify" in line and "pip install 'rlhf_orch[math]'" in line
