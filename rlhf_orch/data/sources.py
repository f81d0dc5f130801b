"""Read the raw records of a prompt file: JSONL (line by line, no extra package), or JSON, parquet, Arrow files
and folders of them (a `save_to_disk` folder too) through the Hugging Face `datasets` library.

Every record comes back with where it came from (`file:line` for JSONL, `file: row i` otherwise), so each
bad row can be named. Problems with the file itself (missing, not UTF-8, unreadable, unknown split, the
`datasets` package not installed) raise one DataError line that names the fix. This module does not look
inside records (prompt keys, chat messages: see rows.py) and does not tokenize.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_orch.errors import DataError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
INSTALL_HINT = 'pip install -e ".[data]"  (or: pip install datasets)'


@dataclass
class BadLine:
    """A JSONL line that is not JSON, kept in its place so problems are reported in file order."""

    message: str


@dataclass
class RawRows:
    """The records of one split, in file order, and where each came from."""

    fmt: str                                     # jsonl | json | parquet | arrow | folder | saved (save_to_disk)
    records: list = field(default_factory=list)  # anything json.loads returned (or a BadLine); datasets rows are dicts
    where: list[str] = field(default_factory=list)


def read_records(source: str, split: str = "train") -> RawRows:
    """The records of `source` (a file or folder; a single file is the split `split`)."""
    path = Path(source)
    if path.is_dir():
        return _read_folder(source, path, split)
    if not path.is_file():
        raise DataError(f"data.source: file {source!r} not found; give a .jsonl, .json, .parquet or .arrow file, "
                        "a folder of them, or builtin:arithmetic")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(source, path)
    if suffix not in BUILDERS:
        raise DataError(f"data.source: {source!r} is not a .jsonl, .json, .parquet or .arrow file; convert it, or "
                        "give a folder of such files or one written by datasets' save_to_disk")
    if suffix == ".json":
        _check_utf8(path)
    datasets = _import_datasets(source, suffix.lstrip("."))
    with _quiet(datasets):
        try:
            ds = datasets.load_dataset(BUILDERS[suffix], data_files={split: str(path.resolve())}, split=split)
        except Exception as e:   # a corrupt or mis-named file: name it, not datasets' traceback
            raise DataError(f"data.source: cannot read {source!r} as {suffix.lstrip('.')} ({_first_line(e)})") from None
    return _from_dataset(ds, suffix.lstrip("."), source)


def _read_jsonl(source: str, path: Path) -> RawRows:
    text = _check_utf8(path)
    out = RawRows("jsonl")
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            record = BadLine(f"{source}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object")
        out.records.append(record)
        out.where.append(f"{source}:{lineno}")
    return out


def _read_folder(source: str, path: Path, split: str) -> RawRows:
    saved = (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    files = [f for f in sorted(path.rglob("*")) if f.is_file() and f.suffix.lower() in BUILDERS]
    if not files:
        raise DataError(f"data.source: folder {source!r} holds no .jsonl, .json, .parquet or .arrow files; "
                        "point data.source at the folder that holds them (or at one file)")
    for f in files:
        if f.suffix.lower() in (".json", ".jsonl"):
            _check_utf8(f)
    datasets = _import_datasets(source, "a saved dataset" if saved else "a data folder")
    with _quiet(datasets):
        try:
            loaded = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path.resolve()))
        except Exception as e:
            what = "a datasets save_to_disk folder" if saved else "a folder of .jsonl, .json, .parquet or .arrow files"
            raise DataError(f"data.source: cannot read {source!r} as {what} ({_first_line(e)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"data.split: {source!r} has no split {split!r}; its splits: {', '.join(loaded)}; "
                            "set data.split to one of them")
        loaded = loaded[split]
    return _from_dataset(loaded, "saved" if saved else "folder", source)


def _from_dataset(ds, fmt: str, source: str) -> RawRows:
    records = ds.to_list()
    return RawRows(fmt, records, [f"{source}: row {i}" for i in range(len(records))])


def _check_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError(f"data.source: {path} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); "
                        f"save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}") from None


def _import_datasets(source: str, what: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.source: reading {source!r} ({what}) needs the Hugging Face datasets library, "
                        f"which is not installed; install it with {INSTALL_HINT}, or give a .jsonl file") from None
    return datasets


class _quiet:
    """No progress bars or warnings from datasets while we read (the driver's log is the user's)."""

    def __init__(self, datasets):
        self.d = datasets

    def __enter__(self):
        self.was, self.level = self.d.is_progress_bar_enabled(), self.d.logging.get_verbosity()
        self.d.disable_progress_bars()
        self.d.logging.set_verbosity(self.d.logging.CRITICAL)   # its warnings and errors repeat the one we report

    def __exit__(self, *exc):
        self.d.logging.set_verbosity(self.level)
        if self.was:
            self.d.enable_progress_bars()


def _first_line(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    cause = e.__cause__ or e.__context__
    text = f"{type(e).__name__}: {msg[0] if msg else ''}"
    if cause is not None and str(cause).strip():   # datasets wraps the real reason (e.g. a JSON syntax error)
        text += f"; {type(cause).__name__}: {str(cause).strip().splitlines()[0]}"
    return text[:300]
