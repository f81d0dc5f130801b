"""Helpers shared by the actor shells: process setup, waiting on actors with readable failures, and killing an
actor's child processes.

Every blocking wait goes through `get()`, which has a timeout and turns Ray's errors into the
project's: a timeout names what was awaited; a dead actor surfaces its own exception and the tail of
its log, so a user does not have to dig through /tmp/ray/session_latest/logs.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlhf_orch.errors import ACTOR_DIED, RLHFOrchError
from rlhf_orch.storage import Store
from rlhf_orch.torch_ext import clear_stale_locks, extensions_dir

logger = logging.getLogger(__name__)


def setup_process(device: str = "cpu") -> None:
    """Called first in every actor: logging, quiet libraries, and one thread per CPU actor.

    It imports neither transformers nor torch: an actor whose module did not (the coordinator, the rollout manager,
    a rule-based reward worker) would pay ~1-3 s of CPU at every start for them (#28 item 6). Where they are not
    imported yet, the same settings go through the environment, which both read at their import."""
    logging.basicConfig(level=os.environ.get("RLHF_ORCH_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")   # transformers' default level, read at its import
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # transformers' progress bars follow the hub's
    if "transformers" in sys.modules:   # imported before this call (the actor's own module): set it directly
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    try:   # a DeepSpeed op build killed earlier on this node must not make this actor wait on its lock forever
        clear_stale_locks(extensions_dir())
    except Exception as e:   # best effort: psutil missing or the folder unreadable must not stop the actor
        logger.debug("stale build lock check skipped: %s", e)
    if device == "cpu":
        # Several actors share few cores; one thread each avoids oversubscription stalls. torch reads
        # OMP_NUM_THREADS for its intra-op pool at import, so an actor that imports it later gets the same.
        threads = os.environ.get("RLHF_ORCH_THREADS", "1")
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
        else:
            os.environ["OMP_NUM_THREADS"] = threads


def kill_descendants(pid: int | None = None) -> list[int]:
    """SIGKILL every process below `pid` (default: this one), deepest first; returns their pids. Read from Linux's
    /proc (the parent field of each process's stat), so it needs no psutil; elsewhere it kills nothing. Why: vLLM's
    engine core (and SGLang's scheduler) is a child of its rollout actor and holds the GPU and the weight-sync group;
    killing the actor alone leaves it running (bench/RESULTS.md, seventh session)."""
    root = os.getpid() if pid is None else pid
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parent[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])   # the name may hold spaces
            except (OSError, IndexError, ValueError):
                continue
    order, todo = [], [root]
    while todo:
        here = todo.pop()
        kids = [p for p, pp in parent.items() if pp == here]
        order += kids
        todo += kids
    for p in reversed(order):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return order


def actor_env(device: str) -> dict[str, str]:
    """Environment for every actor (passed as runtime_env env_vars so `ray start` clusters get it too)."""
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TORCH_EXTENSIONS_DIR": str(extensions_dir()),   # the user's, else one private to the DeepSpeed/torch versions
    }
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
        env["DS_ACCELERATOR"] = "cpu"   # DeepSpeed's own detection warns "Setting accelerator to CPU" in every rank
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE", "RLHF_ORCH_LOG_LEVEL",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "PYTHONPATH"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _log_tail(actor_id: str | None, lines: int = 20) -> str:
    if not actor_id:
        return ""
    try:
        from ray.util.state import get_log
        text = "".join(get_log(actor_id=actor_id, tail=lines, timeout=5))
        return "\n--- last log lines of the actor ---\n" + text.rstrip()
    except Exception:   # the state API is best effort (no dashboard, log already rotated)
        return ""


def _actor_name(actor_id: str | None) -> str:
    """' (<class> <name>, pid N)' of a dead actor, from Ray's state API; '' when unknown."""
    if not actor_id:
        return ""
    try:
        from ray.util.state import get_actor
        a = get_actor(actor_id, timeout=5)
        return f" ({a.class_name} {a.name or actor_id[:8]}, pid {a.pid})" if a else ""
    except Exception:   # best effort, like the log tail
        return ""


def get(refs, timeout: float, what: str, error_cls: type[RLHFOrchError] = RLHFOrchError):
    """ray.get with a timeout; failures become `error_cls` with the actor's own error and log tail."""
    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError:
        raise error_cls(f"timed out after {timeout:.0f}s waiting for {what}; see the Ray dashboard "
                        "(http://127.0.0.1:8265 on a local run) for stuck actors, or raise ray.get_timeout_s") from None
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, RLHFOrchError):
            raise cause from None
        if isinstance(cause, RayActorError):   # an input of the task came from an actor that died (a reference worker)
            actor_id = getattr(cause, "actor_id", None)
            raise error_cls(f"{what} failed: {ACTOR_DIED}{_actor_name(actor_id)} before it delivered an input of this "
                            f"task ({str(cause).splitlines()[0][:300]}){_log_tail(actor_id)}") from None
        raise error_cls(f"{what} failed: {type(cause).__name__}: {cause}") from None
    except RayActorError as e:
        actor_id = getattr(e, "actor_id", None)
        raise error_cls(f"{what} failed: {ACTOR_DIED}{_actor_name(actor_id)} "
                        f"({e.error_msg if hasattr(e, 'error_msg') else e}){_log_tail(actor_id)}") from None


class Located:
    """A base of every actor class: `node()` says which Ray node (and address) this actor runs on, for the
    weight-sync plan (IPC only between processes of one node) and for summary.json's `nodes`."""

    def node(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}

    def upload_files(self, dirs: list[str], uri: str, rel: str) -> dict:
        """The files of a checkpoint on this actor's node (the first of `dirs` there) uploaded to `uri`/`rel`:
        {name: [bytes, sha256]} (driver/checkpoints.py asks one trainer or critic rank per node but the driver's)."""
        for d in dirs:
            if os.path.isdir(d):
                return Store(uri).put_tree(Path(d), rel)
        return {}

    def fetch_tree(self, uri: str, rel: str, local: str) -> int:
        """The folder `uri`/`rel` (a checkpoint) downloaded to `local` on this node where missing: files fetched."""
        return Store(uri).get_tree(rel, Path(local))

    def fetch_file(self, uri: str, rel: str, local: str) -> int:
        """The file `uri`/`rel` (the reference) downloaded to `local` on this node if missing: 1 if it was fetched."""
        return int(Store(uri).get_file(rel, Path(local)))


def beside(node_id: str | None = None) -> dict:
    """Actor options that keep a control-plane actor (weight-sync coordinator, rollout manager, CPU reward workers) on
    the driver's node (`node_id`, default: this process's): on a multi-node cluster they then live and die with the
    driver, not with an engine node that is lost. Hard affinity: Ray's soft affinity spills these zero-CPU actors to
    other nodes as soon as the node's worker pool is at its CPU count (seen on a 3-raylet cluster, Ray 2.60)."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id or ray.get_runtime_context().get_node_id(),
                                                                  soft=False)}
