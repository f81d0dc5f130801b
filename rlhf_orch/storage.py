"""A run folder mirrored to storage every node can read: object stores and other filesystems by URI (s3://, gs://,
hdfs://, file://), through pyarrow.fs.

A run always writes into a local folder (experiment.output_dir / name, on each node); with
`experiment.storage_uri` (or an output_dir given as a URI, which sets it) that folder is mirrored:
- each checkpoint, after its local commit, is uploaded: every node's files by one process on that node (the trainer
  ranks' shards are written by the ranks that own them, on their nodes), then the driver's, then a manifest of every
  file with its digest, then `checkpoints/latest` last. An interrupted upload leaves `latest` on the previous one.
- a resumed or restarted run downloads the checkpoint `latest` names onto each node that needs it before loading, and
  the driver verifies it against the manifest (rlhf_orch/checkpoint.find_good), as for a local checkpoint.
- the run's outputs (metrics, rollouts, summary, timeline, plots) are uploaded with every checkpoint and at the end.

Object stores have no rename, so a remote checkpoint is written in place and `latest` is the commit. This module does
file transfer only (no Ray); driver/checkpoints.py decides when. pyarrow is imported when a Store is made (it is an
optional dependency: the `data` extra), so runs without storage_uri never need it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

from rlhf_orch.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(path: str | None) -> bool:
    return bool(path) and bool(_SCHEME.match(path))


def run_uri(uri: str, name: str) -> str:
    """The run's folder under storage_uri: `name` joined to the path, before any query (`?endpoint_override=...`)."""
    base, sep, query = uri.partition("?")
    return f"{base.rstrip('/')}/{name}{sep}{query}"


def local_mirror(uri: str) -> str:
    """The local folder a run mirrored to `uri` writes into on every node (the same path on each): under
    $RLHF_ORCH_LOCAL_RUNS, else ~/.cache/rlhf_orch/runs, named after the URI."""
    root = os.environ.get("RLHF_ORCH_LOCAL_RUNS") or os.path.join(os.path.expanduser("~"), ".cache", "rlhf_orch", "runs")
    return os.path.join(root, re.sub(r"[^A-Za-z0-9._-]+", "_", uri).strip("_"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


class Store:
    """One URI (a run's remote folder) and the filesystem that serves it."""

    def __init__(self, uri: str):
        try:
            from pyarrow import fs as pafs   # optional (the data extra); only runs with storage_uri get here
        except ImportError as e:
            raise ConfigError(f"experiment.storage_uri: {uri!r} needs pyarrow (pip install 'rlhf_orch[data]')") from e
        self.uri = uri
        self._pafs = pafs
        try:
            self.fs, self.root = pafs.FileSystem.from_uri(self.uri)
        except Exception as e:   # unknown scheme, missing credentials or endpoint: one line naming the field
            raise ConfigError(f"experiment.storage_uri: cannot open {uri!r} ({type(e).__name__}: {e})") from e

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}".rstrip("/") if rel else self.root

    def check_writable(self) -> None:
        """Create the folder and write, read and delete a probe (before any actor starts)."""
        try:
            self.fs.create_dir(self.root, recursive=True)
            self.write(".probe", b"ok")
            assert self.read(".probe") == b"ok"
            self.fs.delete_file(self._path(".probe"))
        except Exception as e:
            raise ConfigError(f"experiment.storage_uri: cannot write to {self.uri!r} ({type(e).__name__}: {e}); check "
                              "the URI, the credentials and the endpoint (e.g. AWS_ENDPOINT_URL)") from e

    def _make_parent(self, rel: str) -> None:
        self.fs.create_dir(self._path(rel).rsplit("/", 1)[0], recursive=True)

    def _download(self, remote_path: str, local: Path) -> None:
        """One remote file to `local`, whole or not at all (through `<local>.part`: two ranks of one node may fetch
        the same checkpoint)."""
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(local.name + ".part")
        try:
            self._pafs.copy_files(remote_path, str(tmp), source_filesystem=self.fs)
            os.replace(tmp, local)
        except OSError as e:
            raise CheckpointError(f"download of {remote_path} from {self.uri} failed: {e}") from e

    def write(self, rel: str, data: bytes) -> None:
        self._make_parent(rel)
        with self.fs.open_output_stream(self._path(rel)) as f:
            f.write(data)

    def read(self, rel: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(self._path(rel)) as f:
                return f.read()
        except (FileNotFoundError, OSError):
            return None

    def get_file(self, rel: str, local: Path) -> bool:
        """Download one file if it exists (streamed; whole, or not at all); returns whether it did."""
        if self.fs.get_file_info(self._path(rel)).type != self._pafs.FileType.File:
            return False
        self._download(self._path(rel), Path(local))
        return True

    def put_file(self, local: Path, rel: str) -> None:
        self._make_parent(rel)
        self._pafs.copy_files(str(local), self._path(rel), destination_filesystem=self.fs)

    def put_tree(self, local: Path, rel: str, skip: tuple[str, ...] = (), hashes: bool = True) -> dict[str, list]:
        """Upload every file under `local` to `rel`/ (names relative to `local`; top-level names in `skip` left out).
        Returns {relative name: [bytes, sha256 (None without `hashes`)]} of what was uploaded."""
        out = {}
        try:
            files = []
            for path in sorted(Path(local).rglob("*")):
                name = path.relative_to(local).as_posix()
                if path.is_file() and name.split("/", 1)[0] not in skip:
                    files.append((path, name, f"{rel}/{name}" if rel else name))
            for parent in sorted({self._path(to).rsplit("/", 1)[0] for *_, to in files}):   # once per folder
                self.fs.create_dir(parent, recursive=True)
            for path, name, to in files:
                self._pafs.copy_files(str(path), self._path(to), destination_filesystem=self.fs)
                out[name] = [path.stat().st_size, _sha256(path) if hashes else None]
        except OSError as e:
            raise CheckpointError(f"upload of {local} to {self.uri}/{rel} failed: {e}") from e
        return out

    def get_tree(self, rel: str, local: Path) -> int:
        """Download every file under `rel`/ into `local` (a file already there with the same size is kept). Returns
        the bytes downloaded; 0 when `rel` does not exist."""
        base = self._path(rel)
        try:
            infos = self.fs.get_file_info(self._pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except OSError as e:
            raise CheckpointError(f"listing {self.uri}/{rel} failed: {e}") from e
        got = 0
        for info in infos:
            if info.type != self._pafs.FileType.File:
                continue
            dest = Path(local) / info.path[len(base):].lstrip("/")
            if dest.exists() and dest.stat().st_size == info.size:
                continue
            self._download(info.path, dest)
            got += info.size
        return got

    def dirs(self, rel: str) -> list[str]:
        infos = self.fs.get_file_info(self._pafs.FileSelector(self._path(rel), allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == self._pafs.FileType.Directory)

    def remove(self, rel: str) -> None:
        try:
            self.fs.delete_dir(self._path(rel))
        except (FileNotFoundError, OSError) as e:
            logger.warning("could not delete %s/%s: %s", self.uri, rel, e)


def storage_problems(uri: str | None, name: str) -> list[str]:
    """experiment.storage_uri reachable and writable (one line naming the field), checked before any actor starts."""
    if not uri:
        return []
    try:
        Store(run_uri(uri, name)).check_writable()
    except ConfigError as e:
        return e.problems
    return []
