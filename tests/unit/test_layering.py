"""rlhf_orch/ is a library without Ray: Ray lives in actors/ and launch.py (a grep, so it also covers lazy imports)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rlhf_orch_never_imports_ray():
    pattern = re.compile(r"^\s*(import ray\b|from ray\b)", re.MULTILINE)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "rlhf_orch").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
