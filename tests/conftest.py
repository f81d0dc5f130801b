"""Shared fixtures: loopback-only Ray and gloo, and a tiny model directory built once per session."""
import logging
import os

import pytest

from rlhf_orch.torch_ext import default_extensions_dir   # the standard library only

# Keep every socket a test opens on 127.0.0.1 (Ray binds routable addresses otherwise; see CPU-NOTES).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The recorded baselines (tests/data/*baseline*.json) compare weight digests bit for bit, and CPU kernels round
# differently on AVX2 and AVX-512 machines (seen 2026-11-26: same packages, other digests). Every process a test
# starts (Ray workers inherit this environment) takes the AVX2 kernels of ATen, MKL and oneDNN, as at recording.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("MKL_CBWR", "AVX2")
os.environ.setdefault("DNNL_MAX_CPU_ISA", "AVX2")
# DeepSpeed's C++ op builds once per machine, in the folder runs use (rlhf_orch/torch_ext.py): tests that train in
# this process, the actors of test runs, .ci/run and `python launch.py` all find it there (issue #31: it was three).
if "TORCH_EXTENSIONS_DIR" not in os.environ:
    os.environ["TORCH_EXTENSIONS_DIR"] = str(default_extensions_dir())


@pytest.fixture
def config_warnings(monkeypatch, caplog):
    """caplog for the config checks' warnings, which each test sees again (the module logs each one once per process)."""
    from rlhf_orch.config import checks   # here: it brings torch in, after the environment above is set
    monkeypatch.setattr(checks, "_warned", set())
    caplog.set_level(logging.WARNING, logger="rlhf_orch.config.checks")
    return caplog


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from rlhf_orch.models import TinyModelSpec, ensure_model_dir   # here, as checks above
    return str(ensure_model_dir("tiny-llama", TinyModelSpec(), tmp_path_factory.mktemp("models"), seed=0))


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the lent device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """The shared Ray of tests/integration/conftest.py: whether it is up, and how to stop it."""
    config.shared_ray_up = False

    def stop_shared_ray() -> None:
        if config.shared_ray_up:
            import ray
            ray.shutdown()
            config.shared_ray_up = False
    config.stop_shared_ray = stop_shared_ray


@pytest.fixture(autouse=True)
def _shared_ray_only_where_asked(request):
    """The integration tests' shared Ray is up only for tests that ask for it (`shared_ray`): any other test starts
    its own Ray, or none, as a run does."""
    if "shared_ray" not in request.fixturenames:
        request.config.stop_shared_ray()


def pytest_sessionfinish(session):
    session.config.stop_shared_ray()
