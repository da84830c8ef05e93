"""The Batch API's state on disk: uploaded files, Batch objects, and their result records.

Layout under the root (``pagedserve serve --batch-dir``)::

    files/<file_id>.json       the File object
    files/<file_id>.jsonl      its content
    batches/<batch_id>.json    {"batch": the Batch object, "state": the runner's own fields}

Every JSON document is written atomically (a temporary file, fsync, rename), so a kill leaves
the old version or the new one; a failed write removes its temporary file, and a start sweeps
those a kill left. Any Python string round-trips: text is written as UTF-8, and a document
holding a lone surrogate (a ``"\\ud800"`` escape in the client's JSON, which UTF-8 cannot
encode) is written with ASCII escapes instead.

A batch's output and error files are ``RecordFile``s: one JSON record per line, appended and
flushed as each line finishes, registered as File objects only when the batch is finalized.
Reopening one cuts off a truncated last record, so a restarted server knows exactly which
lines are done. The store is safe to use from several threads.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedserve.config import cache_root

__all__ = [
    "ACTIVE",
    "TERMINAL",
    "BatchStore",
    "RecordFile",
    "batch_progress",
    "default_batch_dir",
    "encode_json",
    "write_json_atomic",
]

logger = logging.getLogger(__name__)

ACTIVE = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
"""Statuses a runner still has work for (resumed when a server starts)."""
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
COMPLETION_WINDOW_S = 24 * 3600


def default_batch_dir() -> Path:
    """``$XDG_CACHE_HOME/pagedserve/batches`` (``~/.cache`` without the variable)."""
    return cache_root() / "batches"


def encode_json(obj: Any) -> bytes:
    """``obj`` as one line of JSON in UTF-8 (ASCII escapes when it holds a lone surrogate)."""
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        data = encode_json(obj)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class RecordFile:
    """An append-only JSONL file of per-line records (an output or error file).

    ``keys`` lists ``(custom_id, error code)`` of every complete record, ``usage`` sums the
    token usage of the response bodies (a Batch object's ``usage``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self.keys: list[tuple[Any, str | None]] = []
        for rec in self._scan():
            self._count(rec)
        self._f = open(path, "ab")

    def _count(self, rec: dict[str, Any]) -> None:
        err = rec.get("error")
        self.keys.append((rec.get("custom_id"), err.get("code") if isinstance(err, dict) else None))
        resp = rec.get("response")
        usage = resp.get("body", {}).get("usage") if isinstance(resp, dict) else None
        if isinstance(usage, dict):
            self.usage["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
            self.usage["completion_tokens"] += int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            self.usage["cached_tokens"] += int(details.get("cached_tokens") or 0)

    def _scan(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            data = f.read()
        pos = good_end = 0
        while pos < len(data):
            nl = data.find(b"\n", pos)
            end = len(data) if nl < 0 else nl + 1
            try:
                rec = json.loads(data[pos:end])
                if not isinstance(rec, dict) or "custom_id" not in rec:
                    raise ValueError("not a record")
            except ValueError:
                if nl < 0:  # cut short by a kill: drop it, that line is redone
                    logger.warning("%s: dropping a truncated last record", self.path)
                    break
                logger.warning("%s: ignoring an unreadable record at byte %d", self.path, pos)
            else:
                yield rec
            good_end = pos = end
        if good_end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
        elif data and not data.endswith(b"\n"):
            with open(self.path, "ab") as f:
                f.write(b"\n")

    @property
    def count(self) -> int:
        return len(self.keys)

    def append(self, rec: dict[str, Any]) -> None:
        # One write, flushed at once: a kill leaves at most one partial last line.
        self._f.write(encode_json(rec) + b"\n")
        self._f.flush()
        self._count(rec)

    def close(self) -> None:
        self._f.close()


def batch_progress(total: int, out: RecordFile, err: RecordFile) -> dict[str, Any]:
    """``request_counts`` and ``usage`` of a Batch object, from its record files."""
    u = out.usage
    return {
        "request_counts": {"total": total, "completed": out.count, "failed": err.count},
        "usage": {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
        },
    }


class BatchStore:
    """Files and batches under ``root``; every method returns copies, never live state."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()
        self.files_dir = self.root / "files"
        self.batches_dir = self.root / "batches"
        self._lock = threading.RLock()
        for stale in [*self.files_dir.glob(".*.tmp"), *self.batches_dir.glob(".*.tmp")]:
            stale.unlink(missing_ok=True)
        self._files: dict[str, dict[str, Any]] = {}
        for p in self.files_dir.glob("*.json"):
            try:
                self._files[p.stem] = _read_json(p)
            except (OSError, ValueError):
                logger.warning("ignoring the unreadable file record %s", p)
        self._batches: dict[str, dict[str, Any]] = {}
        for p in self.batches_dir.glob("*.json"):
            try:
                self._batches[p.stem] = _read_json(p)
            except (OSError, ValueError):
                logger.warning("ignoring the unreadable batch record %s", p)

    def _make_dirs(self) -> None:
        """Created on first use: a server whose Batch API is never used leaves no trace."""
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)

    # --------------------------------------------------------------------------- files
    def content_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def upload_path(self) -> Path:
        """A fresh temporary path to receive an upload, for ``add_file``."""
        self._make_dirs()
        return self.files_dir / f".upload-{uuid.uuid4().hex}.tmp"

    def add_file(
        self, src: Path | None, filename: str, purpose: str, file_id: str | None = None
    ) -> dict[str, Any]:
        """Register a file: ``src`` is moved in (None: the content is already in place)."""
        file_id = file_id or f"file-{uuid.uuid4().hex}"
        dest = self.content_path(file_id)
        if src is not None:
            os.replace(src, dest)
        meta = {
            "id": file_id, "object": "file", "bytes": dest.stat().st_size,
            "created_at": int(time.time()), "filename": filename, "purpose": purpose,
            "status": "processed", "status_details": None,
        }
        with self._lock:
            write_json_atomic(self.files_dir / f"{file_id}.json", meta)
            self._files[file_id] = meta
        return dict(meta)

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        with self._lock:
            meta = self._files.get(file_id)
            return dict(meta) if meta is not None else None

    def list_files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            metas = [dict(m) for m in self._files.values()]
        metas = [m for m in metas if purpose is None or m["purpose"] == purpose]
        return sorted(metas, key=lambda m: (m["created_at"], m["id"]), reverse=True)

    def delete_file(self, file_id: str) -> bool:
        with self._lock:
            if self._files.pop(file_id, None) is None:
                return False
            (self.files_dir / f"{file_id}.json").unlink(missing_ok=True)
            self.content_path(file_id).unlink(missing_ok=True)
            return True

    # ------------------------------------------------------------------------- batches
    def create_batch(
        self, input_file_id: str, endpoint: str, completion_window: str,
        metadata: dict[str, str] | None, model: str | None = None,
    ) -> dict[str, Any]:
        now = int(time.time())
        batch_id = f"batch_{uuid.uuid4().hex}"
        batch = {
            "id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW_S,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata, "model": model, "usage": None,
        }
        state = {
            "seq": time.time_ns(),
            "output_file_id": f"file-{uuid.uuid4().hex}",
            "error_file_id": f"file-{uuid.uuid4().hex}",
        }
        self._make_dirs()
        with self._lock:
            doc = {"batch": batch, "state": state}
            self._persist(batch_id, doc)  # first: a batch that cannot be stored never exists
            self._batches[batch_id] = doc
        return copy.deepcopy(batch)

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        with self._lock:
            doc = self._batches.get(batch_id)
            return copy.deepcopy(doc["batch"]) if doc is not None else None

    def state(self, batch_id: str) -> dict[str, Any]:
        with self._lock:
            return dict(self._batches[batch_id]["state"])

    def update(self, batch_id: str, *, persist: bool = True, **fields: Any) -> dict[str, Any]:
        """Set fields of the Batch object (``persist=False``: in memory only, for counts)."""
        with self._lock:
            doc = self._batches[batch_id]
            batch = {**doc["batch"], **copy.deepcopy(fields)}
            if persist:  # before the change in memory: a failed write changes nothing
                self._persist(batch_id, {**doc, "batch": batch})
            doc["batch"] = batch
            return copy.deepcopy(batch)

    def transition(
        self, batch_id: str, from_statuses: frozenset[str] | set[str], status: str,
        **fields: Any,
    ) -> dict[str, Any] | None:
        """Move to ``status`` (stamping ``<status>_at``) only from one of ``from_statuses``;
        returns the new Batch object, or None when its status was another."""
        with self._lock:
            batch = self._batches[batch_id]["batch"]
            if batch["status"] not in from_statuses:
                return None
            stamp = f"{status}_at"
            if stamp in batch and batch[stamp] is None:
                fields.setdefault(stamp, int(time.time()))
            return self.update(batch_id, status=status, **fields)

    def list_batches(
        self, limit: int = 20, after: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """Newest first; ``after``: the id the previous page ended with. (page, has_more)"""
        with self._lock:
            ids = self._ordered(reverse=True)
            if after is not None:
                ids = ids[ids.index(after) + 1:] if after in ids else []
            page = [copy.deepcopy(self._batches[i]["batch"]) for i in ids[:limit]]
            return page, len(ids) > limit

    def active_batches(self) -> list[str]:
        """Ids of the batches a runner still has work for, oldest first."""
        with self._lock:
            return [i for i in self._ordered() if self._batches[i]["batch"]["status"] in ACTIVE]

    def uses_file(self, file_id: str) -> bool:
        """Whether an unfinished batch reads ``file_id``."""
        with self._lock:
            return any(
                d["batch"]["input_file_id"] == file_id and d["batch"]["status"] in ACTIVE
                for d in self._batches.values()
            )

    def _ordered(self, reverse: bool = False) -> list[str]:
        return sorted(
            self._batches, key=lambda i: (self._batches[i]["state"]["seq"], i), reverse=reverse
        )

    def _persist(self, batch_id: str, doc: dict[str, Any]) -> None:
        write_json_atomic(self.batches_dir / f"{batch_id}.json", doc)
