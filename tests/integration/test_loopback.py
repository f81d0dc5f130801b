"""A local Ray started by launch.py listens on loopback only. The run this is checked on is test_driver_kill.py's
resumed run (in that test's process, its own local Ray started as launch.py does it; it was a 2-step run of its own
here, a start-up CI no longer pays): while it is up, `watch_listeners` lists every listening TCP socket of this
process's descendants (GCS, raylet, dashboard and its agents, metrics, every actor's core worker), and each must be
bound to 127.0.0.1 or ::1. `non_loopback` is checked here on a made-up socket list, so that assertion can fail."""
import contextlib
import ipaddress
import threading
from collections import namedtuple

import psutil

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


@contextlib.contextmanager
def watch_listeners(every_s: float = 0.3):
    """{(pid, ip, port): Listener} of every socket this process's descendants listened on while the block ran (a thread
    looks every `every_s`), filled in place."""
    seen: dict[tuple, Listener] = {}
    done = threading.Event()

    def watch():
        while not done.is_set():
            for s in listeners_of_descendants():
                seen[(s.pid, s.ip, s.port)] = s
            done.wait(every_s)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        done.set()
        t.join(timeout=10)
