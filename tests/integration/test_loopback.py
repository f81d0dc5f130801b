"""A local Ray started by launch.py listens on loopback only: while a real 2-step CPU run (configs/tiny_cpu.yaml,
in this process) is up, a thread lists every listening TCP socket of this process's descendants (GCS, raylet,
dashboard and its agents, metrics, every actor's core worker) and each must be bound to 127.0.0.1 or ::1.
`non_loopback` is checked on a made-up socket list too, so the assertion can fail."""
import ipaddress
import sys
import threading
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

Listener = namedtuple("Listener", "pid name ip port")


def non_loopback(listeners: list[Listener]) -> list[Listener]:
    """The listeners not bound to a loopback address (0.0.0.0 and :: listen on every interface: not loopback)."""
    bad = []
    for s in listeners:
        ip = ipaddress.ip_address(s.ip.split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            ip = ip.ipv4_mapped
        if not ip.is_loopback:
            bad.append(s)
    return bad


def listeners_of_descendants() -> list[Listener]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            conns = p.net_connections(kind="inet") if hasattr(p, "net_connections") else p.connections(kind="inet")
            name = p.name()
        except psutil.Error:   # exited meanwhile
            continue
        out += [Listener(p.pid, name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def test_non_loopback_check():
    fake = [Listener(1, "gcs_server", "127.0.0.1", 6379), Listener(2, "raylet", "::1", 5),
            Listener(3, "worker", "::ffff:127.0.0.1", 6), Listener(4, "dashboard", "0.0.0.0", 8265),
            Listener(5, "raylet", "10.0.0.7", 7), Listener(6, "agent", "::", 8)]
    assert [s.pid for s in non_loopback(fake)] == [4, 5, 6]


@pytest.mark.integration
def test_local_ray_listens_on_loopback_only(tmp_path, monkeypatch):
    import launch
    # What launch.py itself does, not what this shell exported (init_ray sets it only when unset).
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    seen: dict[tuple, Listener] = {}
    done = threading.Event()

    def watch():
        while not done.is_set():
            for s in listeners_of_descendants():
                seen[(s.pid, s.ip, s.port)] = s
            done.wait(0.3)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        rc = launch.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"experiment.output_dir={tmp_path}",
                          "experiment.name=loopback", "experiment.steps=2", "trainer.warm_start_steps=0",
                          "ray.num_cpus=2", "metrics.trackers=[jsonl]", "metrics.plots=false",
                          "metrics.ray_metrics=false"])
    finally:
        done.set()
        t.join(timeout=10)
    assert rc == 0
    names = {s.name for s in seen.values()}
    # It saw Ray itself and the actors' workers, not an empty list.
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), names
    assert any(n.startswith("ray::") for n in names), names
    assert not non_loopback(list(seen.values())), non_loopback(list(seen.values()))
