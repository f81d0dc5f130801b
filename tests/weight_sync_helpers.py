"""Helpers shared by the weight-sync unit tests (bit-exact comparisons, specs, child-process cleanup)."""
import torch

from rlhf_orch.types import ParamSpec

HOST = "127.0.0.1"
CPU = torch.device("cpu")
CHILD_TIMEOUT_S = 60.0     # generous: only reached when something is broken
GROUP_TIMEOUT_S = 30.0


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as uint8, for bit-exact comparisons (distinguishes -0.0 from 0.0, NaN payloads)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str = ""):
    assert a.dtype == b.dtype, what
    assert tuple(a.shape) == tuple(b.shape), what
    assert torch.equal(raw_bytes(a), raw_bytes(b)), what


def spec(name, dtype, *shape) -> ParamSpec:
    return ParamSpec(name, dtype, tuple(shape))


def stop_children(procs, timeout=5.0):
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


