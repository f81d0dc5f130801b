"""A sync whose engine does not end up holding the sender's bytes must be caught.

Real sender and receivers over the ipc transport (shared memory, in one process); one receiver's
load skips a tensor, as a buggy engine loader would. That engine refuses the sync itself (its stream compares every
tensor with the trainer's checksums), and the coordinator's rule, which engines without that check rely on
(tensor-parallel SGLang), names the same tensor from the checksums it reports. No actors: the rule itself is under
test here, and the Ray integration tests run the same function inside the coordinator on every step.
"""
import pytest
import torch

from rlhf_orch.errors import WeightSyncError
from rlhf_orch.types import ParamSpec
from rlhf_orch.weight_sync import WeightReceiver, WeightSender, make_plan, plan_buckets
from rlhf_orch.weight_sync.buckets import checksums
from rlhf_orch.weight_sync.verify import mismatches
from weight_sync_helpers import in_process_streams


def _engine(params, skip=None):
    def load(named):
        for n, t in named:
            if n != skip:
                params[n].copy_(t)
    return load, (lambda names: checksums(params[n] for n in names))


def test_skipped_tensor_is_reported_and_good_engine_passes():
    torch.manual_seed(0)
    trainer = {f"layer{i}.weight": torch.randn(64, 16) for i in range(6)}
    specs = [ParamSpec(n, "float32", tuple(t.shape)) for n, t in trainer.items()]
    layouts = plan_buckets(specs, bucket_bytes=8192)
    assert len(layouts) >= 3
    plan = make_plan(["slot0", "slot1"], {"good": ["slot0"], "bad": ["slot0"]})
    engines = {}
    for name, skip in (("good", None), ("bad", "layer4.weight")):
        params = {n: torch.zeros_like(t) for n, t in trainer.items()}
        load, sums = _engine(params, skip)
        engines[name] = WeightReceiver(layouts, torch.device("cpu"), load, sums)
    sender = WeightSender(layouts, torch.device("cpu"), {"ipc": {"engines": ["good", "bad"]}}, timeout_s=30)
    sync = in_process_streams(sender, engines, timeout_s=30)
    with pytest.raises(WeightSyncError, match="gave up"):
        sync(iter(trainer.items()))
    want = checksums(trainer.values())
    good = [engines["good"].last_sums[n] for n in trainer]
    bad = [engines["bad"].last_sums[n] for n in trainer]   # what the bad engine holds, as it would report it
    assert good == want
    lines = mismatches(plan, layouts, [want, []], {"good": good, "bad": bad})
    assert len(lines) == 1
    assert lines[0].startswith("bad (ipc): 6 checksums vs 6 expected; first differing tensors: ['layer4.weight']")


def test_missing_report_is_a_mismatch():
    specs = [ParamSpec("w", "float32", (4,))]
    layouts = plan_buckets(specs, 1024)
    plan = make_plan(["slot0"], {"far": ["slot9"]})
    assert mismatches(plan, layouts, [[1]], {}) == ["far (broadcast): reported no checksums"]
    assert mismatches(plan, layouts, [[1]], {"far": [1]}) == []
