"""The Ray session of a driver: join the cluster named by RAY_ADDRESS / `ray.address`, or start a local single-node
Ray on loopback (with the watchdog that removes it if the driver is SIGKILLed), and shut down only a Ray this
process started. It does not place or start any actor (driver/placement.py, driver/cluster.py)."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import ray

from driver.watchdog import start_watchdog

_started: list[bool] = []   # a local Ray that init_ray started and stop_ray has not shut down yet


def init_ray(cfg, shared: bool = False) -> bool:
    """Join RAY_ADDRESS / ray.address if given, else start a local Ray. Returns True if we started it.
    `shared`: a Ray its caller shuts down itself (a test module's), which stop_ray leaves up."""
    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    # A Ray this driver starts is single-node: keep it and the gloo groups on loopback (Ray otherwise
    # binds the machine's routable address). Joining a cluster (above) leaves the environment alone.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        # Ray reads the variable once, when `ray` is imported (ray_constants.ENABLE_RAY_CLUSTER), which was before
        # this function: without this line the driver picks the routable IP and GCS, raylet and every worker listen
        # on all interfaces (tests/integration/test_driver_kill.py's resumed run). The children read the variable set above.
        from ray._private import ray_constants
        ray_constants.ENABLE_RAY_CLUSTER = False
    # Workers of a local Ray must import this checkout even when it is not pip-installed.
    root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    # address="local": always a new instance; a cluster left running by `ray start` is joined only when named.
    ray.init(address="local", num_cpus=cfg.ray.num_cpus, log_to_driver=True)
    if not shared:
        _started.append(True)
    start_watchdog()   # a SIGKILLed driver must not leave this Ray running (see driver/watchdog.py)
    return True


def stop_ray() -> None:
    """Shut down the Ray that init_ray started (a joined cluster and a test's shared Ray stay up), keeping this
    process's SIGTERM handler. Ray's core worker resets SIGTERM to the default action as it shuts down
    (RayLog::UninstallSignalAction in _raylet.so) while Python still believes its handler is set: a second SIGTERM
    after that (`ray job stop` on a loaded machine repeats itself) killed the driver with -15 (CI, 2026-11-27).
    The handler is set again once shutdown returns; during the second or so Ray then spends stopping its own
    processes a SIGTERM still ends the driver at once, which is why launch.py writes summary.json before this."""
    if not _started:
        return
    _started.clear()
    handler = signal.getsignal(signal.SIGTERM)
    ray.shutdown()
    if callable(handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
