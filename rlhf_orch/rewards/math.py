"""Answer rewards for math word problems: extract the model's final answer, compare it with the row's answer using
math-verify (Hugging Face's `math_verify.parse` and `verify`: 1/2 equals 0.5 and \\frac{1}{2}, 72 equals 72.0).

    reward.function: rlhf_orch.rewards.math:gsm8k
        GSM8K-style. The response's final answer is the number after its last "####" (GSM8K's own format), else the
        content of its last \\boxed{...}, else the last number anywhere in it. The row's answer (`data.answer_key`)
        may be the bare number (verl's reward_model.ground_truth) or a whole GSM8K solution ending in "#### 72".
        Thousands separators and a leading "$" are dropped. 1.0 if the numbers are equal, else 0.0.

    reward.function: rlhf_orch.rewards.math:math_answer
        MATH-style. The response's final answer is the content of its last complete \\boxed{...} (or \\fbox{...},
        or "\\boxed 5"), braces nested to any depth; without one the response scores 0.0 (free text is too
        ambiguous to read an answer from). The row's answer may be the bare LaTeX answer or a whole solution with
        a \\boxed{...} in it. 1.0 if math-verify finds the two expressions equal (symbolically or numerically),
        else 0.0.

A response with no answer scores 0.0; nothing here raises on a model's text. math-verify is an optional extra
(`pip install 'rlhf_orch[math]'`): importing this module without it raises ImportError with that command, so a
config naming these functions fails when it loads, before anything starts.

math-verify bounds its own parsing and comparing with signal.alarm (5 s), which only works in a process's main
thread; elsewhere (e.g. under `reward.timeout_s`, which runs a sync function in a worker thread) its own timeout is
switched off and reward.timeout_s is the bound. This module does not score formatting or reasoning, only the answer.
"""
from __future__ import annotations

import re
import threading

try:
    from math_verify import parse, verify
except ImportError as e:   # an optional extra: say how to get it (the config loader shows this message)
    raise ImportError("the math rewards need the math-verify package, an optional extra of rlhf_orch; install it "
                      "with: pip install 'rlhf_orch[math]'") from e

__all__ = ["gsm8k", "math_answer", "gsm8k_final_answer", "last_boxed", "last_number"]

MATH_VERIFY_TIMEOUT_S = 5   # math-verify's own default; used only in the main thread (see the module docstring)
# A number with optional sign, thousands separators and decimals: "1,234.5", "-3", ".5".
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_BOX = re.compile(r"\\(?:boxed|fbox)")


def last_boxed(text: str) -> str | None:
    """The content of the last complete \\boxed{...} / \\fbox{...} in `text` (nested braces kept), or None.

    "\\boxed 5" (a space, no braces) gives what follows up to the next space or "$". An unclosed last box (a
    response cut off mid-answer) gives None: the final answer is missing, an earlier box was not the final one."""
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    at = starts[-1]
    if text.startswith(" ", at):
        m = re.match(r" +([^\s$]+)", text[at:])
        return m.group(1) if m else None
    if not text.startswith("{", at):
        return None
    depth = 0
    for i in range(at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[at + 1:i].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number in `text`, thousands separators removed ("1,234" -> "1234"), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm8k_final_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style text: the number after its last "####", else in its last \\boxed{},
    else its last number. A "####" with no number after it is an answer that is missing (None), not a cue to look
    further back."""
    if "####" in text:
        return _first_number(text.rsplit("####", 1)[1].split("\n", 1)[0])
    boxed = last_boxed(text)
    if boxed is not None:
        return _first_number(boxed)
    return last_number(text)


def gsm8k(response: str, row: dict) -> float:
    """1.0 if the response's final answer (#### N, else \\boxed{N}, else the last number) equals the row's, else 0.0."""
    gold = gsm8k_final_answer(str(row["answer"]))
    pred = gsm8k_final_answer(response)
    if gold is None or pred is None:
        return 0.0
    return 1.0 if _equal(gold, pred) else 0.0


def math_answer(response: str, row: dict) -> float:
    """1.0 if the response's last \\boxed{...} is mathematically equal to the row's answer, else 0.0."""
    answer = str(row["answer"]).strip()
    gold = last_boxed(answer) if _BOX.search(answer) else answer.strip("$ ")
    pred = last_boxed(response)
    if not gold or not pred:
        return 0.0
    # Both go in as a box: math-verify then reads them as LaTeX (and falls back to the plain string when it cannot).
    return 1.0 if _equal("\\boxed{" + gold + "}", "\\boxed{" + pred + "}") else 0.0


def _first_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[0].replace(",", "") if found else None


def _equal(gold: str, pred: str) -> bool:
    # signal.alarm works only in the main thread; elsewhere math-verify raises unless its timeout is off.
    main = threading.current_thread() is threading.main_thread()
    timeout = MATH_VERIFY_TIMEOUT_S if main else None
    return bool(verify(parse(gold, parsing_timeout=timeout), parse(pred, parsing_timeout=timeout),
                       timeout_seconds=timeout))
