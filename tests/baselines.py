"""The recorded baselines (tests/data/*_baseline.json), for the kind of CPU the tests run on.

Weight digests are compared bit for bit, and CPU kernels round differently on different processors even with the
AVX2 kernels forced (tests/conftest.py): the 2026-11-26 recording (Intel Xeon) does not reproduce on an AMD EPYC
machine of the same kind, same packages, same code (2026-11-27: digests differ from step 1, train/grad_norm by up to
2.8e-6 at step 20). So a baseline file holds one recording per CPU vendor: the top-level one for `cpu` (the
first), others under `other_cpus`. A machine whose vendor has no recording fails with the command that records one
(tests/record_baseline.py, run on a checkout of the commit named in `recorded_from`), never silently passes.
"""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def cpu_vendor() -> str:
    """'GenuineIntel', 'AuthenticAMD', ... from /proc/cpuinfo ('unknown' elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def baseline(name: str) -> dict:
    """{'keys': [...], 'steps': [...], 'recorded_from': ..., 'command': ...} of `name` for this machine's CPU."""
    path = DATA / f"{name}_baseline.json"
    data = json.loads(path.read_text())
    vendor = cpu_vendor()
    if data.get("cpu", "GenuineIntel") == vendor:
        return data
    rec = data.get("other_cpus", {}).get(vendor)
    if rec is None:
        raise AssertionError(f"{path.name} has no recording for this CPU ({vendor}); record one on a checkout of the "
                             f"commit named in its recorded_from: python tests/record_baseline.py {name}")
    return {**{k: data[k] for k in ("keys", "command")}, **rec}
