"""Compare what every engine holds after a sync with what its sender packed.

Pure function over checksum lists, so the rule that decides whether a step may go on is tested
without actors. Each engine is compared with the trainer rank that sent to it; a mismatch names the
engine, its transport and the first differing tensors.
"""
from __future__ import annotations

from typing import Sequence

from rlhf_orch.weight_sync.buckets import BucketLayout
from rlhf_orch.weight_sync.plan import SyncPlan


def mismatches(plan: SyncPlan, layouts: Sequence[BucketLayout], sent: Sequence[list[int]],
               reported: dict[str, list[int]]) -> list[str]:
    """`sent[r]`: rank r's checksums; `reported[engine]`: the checksums of what that engine holds, whatever its
    transport. Returns one line per bad engine."""
    names = [s.name for b in layouts for s in b.slots]
    out = []
    for engine, route in plan.routes.items():
        want = sent[route.sender_rank]
        got = reported.get(engine)
        if got is None:
            out.append(f"{engine} ({route.transport}): reported no checksums")
        elif got != want:
            bad = [n for n, g, w in zip(names, got, want) if g != w][:5]
            out.append(f"{engine} ({route.transport}): {len(got)} checksums vs {len(want)} expected; "
                       f"first differing tensors: {bad}")
    return out
