"""The audit log: one JSON object per line, appended, never rewritten.

Every decision the policy takes lands here, skipped ones included: what (kind, layers, epoch), why
(the reason in words and the verdicts behind it) and the numbers before and after. Each line is
flushed as it is written so a crash loses at most the line being written; `close` fsyncs, so a clean
shutdown (SIGTERM) leaves everything on disk.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    return value


class AuditLog:
    """Append-only JSONL file. Thread-safe; `record` returns the line's object."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: every write lands at the end even if another process appends too. O_NOFOLLOW: a
        # symlink planted at the path is refused, never followed to someone else's file.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            if stat.S_IMODE(st.st_mode) != 0o640:
                os.fchmod(fd, 0o640)  # decisions are not for every local user: reset a wider mode
        except OSError:
            os.close(fd)
            raise
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self.records_written = 0

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        entry = {"time": round(time.time(), 6), "event": event, **jsonable(fields)}
        line = json.dumps(entry, sort_keys=False, allow_nan=False, separators=(",", ":"))
        with self._lock:
            if self._file.closed:
                raise ValueError(f"audit log {self.path} is closed")
            self._file.write(line + "\n")
            self._file.flush()
            self.records_written += 1
        return entry

    def writable(self) -> bool:
        return not self._file.closed and os.access(self.path, os.W_OK)

    def sync(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def read_audit(path: str | Path) -> list[dict[str, Any]]:
    """Every record of an audit log, in order."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
