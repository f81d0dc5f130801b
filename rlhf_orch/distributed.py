"""Rendezvous helpers: a TCPStore that listens only on the address it is given, free ports, and joining a
DeepSpeed rank's process group through that store (`init_rank`).

torch's TCPStore server binds every interface whatever host it is told. We bind the listening
socket ourselves to the chosen address (loopback on a local run, the node's IP on a cluster) and
hand it over with `master_listen_fd`, so a run exposes no port beyond the address it actually uses.
"""
from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

_LISTENING: list[socket.socket] = []


def free_port(host: str) -> int:
    """A TCP port free on `host` right now (the store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                          master_listen_fd=sock.fileno())
    _LISTENING.append(sock)   # the store serves on this socket: it must stay open (stores live per process)
    return store


def import_deepspeed():
    """`import deepspeed`, without MLflow: DeepSpeed's autotuner imports mlflow whenever it is installed
    (deepspeed/autotuning/autotuner.py:31; our mlflow tracker extra installs it), ~2 s of every rank's start on
    2 CPU cores, for DeepSpeed's autotuning, which no role here runs. The driver's tracker imports mlflow itself.
    Every DeepSpeed role takes DeepSpeed through here (a plain `import deepspeed` first would bring mlflow in)."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed
        return deepspeed
    sys.modules["mlflow"] = None   # `import mlflow` raises ImportError while DeepSpeed is imported
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]
    return deepspeed


def init_rank(rank: int, world_size: int, device: str) -> torch.device:
    """Join this process's data-parallel group as `rank` of `world_size` (nccl on cuda, gloo on cpu), through our
    store at MASTER_ADDR:MASTER_PORT (set by the actor shell), and tell DeepSpeed to adopt it. Returns the device
    the rank computes on (cuda: LOCAL_RANK's GPU of those Ray made visible). Used by every DeepSpeed role: the
    policy ranks and a critic group of its own."""
    deepspeed = import_deepspeed()   # the first import in a rank's process
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    store = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, rank == 0,
                      timedelta(minutes=10))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    deepspeed.init_distributed(dist_backend=backend)
    return dev
