"""`shared_ray`: one local Ray for every run of a test module, which each run joins as it joins a cluster.

A run that finds Ray already initialised uses it and leaves it up (actors/ray_session.init_ray returns False, and
its stop_ray leaves it alone), the path
of `ray.address` / RAY_ADDRESS on a cluster. Starting and stopping a local Ray costs ~6 s per run on the 2-core CI
machine, and the modules that use this fixture make 2-11 runs each. Every run still starts its own actors and
placement group and removes them at its end (a left-over named actor would fail the next run of the module).

Not for modules whose runs need their own Ray: environment variables set by the test for the actors (Ray's
workers inherit the raylet's environment, fixed when Ray starts), a Ray started with other resources or options,
or a driver in another process.
"""
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def shared_ray():
    import ray
    from actors.ray_session import init_ray
    init_ray(SimpleNamespace(ray=SimpleNamespace(address=None, num_cpus=2)), shared=True)   # what `ray.num_cpus=2` runs start
    yield
    ray.shutdown()
