"""Record a baseline (tests/data/NAME_baseline.json) for this machine's CPU vendor (tests/baselines.py says why).

    python tests/record_baseline.py tiny_cpu_20steps --code /path/to/checkout/of/the/recorded/commit

Runs the file's own `command` with launch.py from `--code` (default: this checkout) under the tests' kernel settings
(tests/conftest.py) and writes the recording beside the others: at the top level if this CPU is the file's `cpu`,
else under `other_cpus`. The numbers must come from the code named in `recorded_from`, not from a change under test:
check out that commit (git worktree add DIR COMMIT) and pass it as --code.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from baselines import DATA, cpu_vendor  # noqa: E402

ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo", "TOKENIZERS_PARALLELISM": "false",
       "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"}   # as tests/conftest.py


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="e.g. tiny_cpu_20steps (tests/data/NAME_baseline.json)")
    ap.add_argument("--code", default=str(HERE.parent), help="checkout whose launch.py makes the numbers")
    args = ap.parse_args(argv)
    path = DATA / f"{args.name}_baseline.json"
    data = json.loads(path.read_text())
    code = Path(args.code).resolve()
    commit = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    with tempfile.TemporaryDirectory() as out:
        cmd = shlex.split(data["command"].replace("python ", f"{sys.executable} ", 1))
        cmd += [f"experiment.output_dir={out}", "experiment.name=baseline"]
        env = {**os.environ, **ENV, "PYTHONPATH": f"{code}:{code / 'tests'}"}
        print("running:", " ".join(cmd), "in", code, flush=True)
        subprocess.run(cmd, cwd=code, env=env, check=True)
        records = [json.loads(line) for line in (Path(out) / "baseline" / "metrics.jsonl").read_text().splitlines()]
    steps = [{"step": r["step"], **{k: r[k] for k in data["keys"] if k in r}} for r in records]   # warm-up steps lack some
    packages = "; ".join(f"{p} {metadata.version(p)}" for p in
                         ("deepspeed", "numpy", "ray", "safetensors", "tokenizers", "torch", "transformers"))
    rec = {"recorded_from": f"main {commit}, {datetime.date.today()}, {_cpu_model()} ({cpu_vendor()}), with "
                            f"tests/conftest.py's AVX2 kernel settings. Packages: {packages}", "steps": steps}
    vendor = cpu_vendor()
    if data.setdefault("cpu", "GenuineIntel") == vendor:
        data.update(rec)
    else:
        data.setdefault("other_cpus", {})[vendor] = rec
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"recorded {len(steps)} steps for {vendor} into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
