"""CPU checks of the SGLang engine's pure parts (no SGLang needed).

1. `bucket_request` pads our 256-byte aligned bucket so SGLang's tight packing reproduces it byte for
   byte: the packing rule below is FlattenedTensorBucket's (sglang 0.5.17 weight_sync/tensor_bucket.py:50-72:
   each tensor flattened to uint8 and concatenated in request order).
2. The load wrapper that `rlhf_sglang_hook` installs in each scheduler drops padding and warm-up entries,
   loads the rest through the model's own load_weights, and reports the received tensors' checksums.
"""
import json

import torch

from rlhf_orch.engines.sglang import _PAD, _WARMUP, bucket_request, install
from rlhf_orch.types import ParamSpec, dtype_from_name
from rlhf_orch.weight_sync.buckets import checksums, pack, plan_buckets, unpack


def sglang_pack(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[tuple[str, int, int]]]:
    """FlattenedTensorBucket(named_tensors=...): (flat uint8 buffer, [(name, start, end)])."""
    flats, meta, pos = [], [], 0
    for name, t in named:
        f = t.flatten().view(torch.uint8)
        meta.append((name, pos, pos + f.numel()))
        pos += f.numel()
        flats.append(f)
    return torch.cat(flats), meta


def test_padded_request_reproduces_our_layout():
    specs = [ParamSpec("a", "bfloat16", (3, 5)), ParamSpec("b", "float32", (7,)), ParamSpec("c", "int8", (13,)),
             ParamSpec("d", "bfloat16", (64,)), ParamSpec("e", "float16", (1, 3))]
    layouts = plan_buckets(specs, 1 << 20)
    assert len(layouts) == 1 and any(s.offset % 256 == 0 and s.offset > 0 for s in layouts[0].slots)
    lay = layouts[0]
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s.shape, generator=g).to(dtype_from_name(s.dtype)) for s in specs]
    ours = torch.zeros(lay.nbytes, dtype=torch.uint8)
    pack(lay, tensors, ours)

    names, dtypes, shapes = bucket_request(lay)
    assert [n for n in names if not n.startswith(_PAD)] == [s.name for s in specs]
    # What SGLang's receiver allocates for this request: empties of these dtypes/shapes, concatenated.
    recv = [(n, torch.empty(sh, dtype=dtype_from_name(dt))) for n, dt, sh in zip(names, dtypes, shapes)]
    flat, meta = sglang_pack(recv)
    assert flat.numel() == lay.nbytes
    starts = {n: (a, b) for n, a, b in meta}
    for s in lay.slots:
        assert starts[s.name] == (s.offset, s.offset + s.nbytes)
    # Bytes broadcast from our buffer land where SGLang's reconstruct_tensors reads them.
    flat.copy_(ours)
    for (name, a, b), dt, sh in zip(meta, dtypes, shapes):
        if name.startswith(_PAD):
            continue
        got = flat[a:b].view(dtype_from_name(dt)).reshape(sh)
        want = dict(unpack(lay, ours))[name]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_unaligned_tail_needs_no_trailing_pad():
    lay = plan_buckets([ParamSpec("x", "int8", (3,)), ParamSpec("y", "int8", (5,))], 1 << 20)[0]
    names, _, shapes = bucket_request(lay)
    assert names == ["x", f"{_PAD}1", "y"] and shapes == [[3], [253], [5]]


class _Tiny(torch.nn.Module):
    """A model with SGLang's load_weights shape: (name, tensor) pairs in, unknown names skipped."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.seen: list[list[str]] = []

    def load_weights(self, weights):
        weights = list(weights)
        self.seen.append([n for n, _ in weights])
        params = dict(self.named_parameters())
        for n, t in weights:
            if n in params:
                params[n].data.copy_(t)
        return {n for n, _ in weights}


def test_hook_wrapper_drops_reserved_names_and_reports_checksums(tmp_path):
    model = _Tiny()
    install(model, {"dir": str(tmp_path), "verify": True}, rank=0, uuid="u0")
    rec = json.loads((tmp_path / "tp0.json").read_text())
    assert rec["seq"] == 0 and rec["uuid"] == "u0"

    w = torch.arange(16, dtype=torch.float32).view(4, 4)
    model.load_weights([(f"{_PAD}0", torch.zeros(3, dtype=torch.uint8)), ("w", w), (_WARMUP, torch.ones(8, dtype=torch.uint8))])
    assert model.seen == [["w"]] and torch.equal(model.w, w)
    rec = json.loads((tmp_path / "tp0.json").read_text())
    assert rec["seq"] == 1 and rec["sums"] == checksums([w]) and rec["warmup_ok"] is True

    # Re-installing keeps the model's own method underneath (no wrapper around a wrapper) and restarts seq.
    install(model, {"dir": str(tmp_path), "verify": False}, rank=0, uuid="u0")
    model.load_weights([("w", w * 2)])
    rec = json.loads((tmp_path / "tp0.json").read_text())
    assert rec["seq"] == 1 and rec["sums"] == [] and model.seen[-1] == ["w"] and len(model.seen) == 2
