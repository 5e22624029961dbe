"""What every in-engine adapter shares: where its Windows go, chosen by the environment.

- `MOEWATCH_SOCKET`: the agent's unix socket; windows go through the runtime's non-blocking Sender
  (a bounded queue and a background thread: a slow or absent agent costs the engine nothing);
- `MOEWATCH_WINDOW_DIR`: one JSON file per window, written to a temporary name and renamed, so a
  reader never sees half a window.
Neither set: no sinks, and the adapter stays out of the engine's way.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Callable, Mapping

from moewatch import wire
from moewatch.telemetry import Window

SOCKET_ENV = "MOEWATCH_SOCKET"
WINDOW_DIR_ENV = "MOEWATCH_WINDOW_DIR"

Sink = Callable[[Window], object]


class DirectorySink:
    """Each window as `window-<end_time>-<pid>-<n>.json` in `folder`, atomically."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._seq = itertools.count()

    def __call__(self, window: Window) -> Path:
        name = f"window-{window.end_time:.6f}-{os.getpid()}-{next(self._seq)}.json"
        tmp = self.folder / f".{name}.tmp"
        tmp.write_text(window.to_json())
        return tmp.replace(self.folder / name)


def env_sinks(hello: Callable[[], wire.Hello], environ: Mapping[str, str] | None = None) -> tuple[list[Sink], list]:
    """(sinks, closers) from MOEWATCH_SOCKET / MOEWATCH_WINDOW_DIR; both empty when neither is set."""
    environ = os.environ if environ is None else environ
    sinks: list[Sink] = []
    closers: list = []
    if environ.get(SOCKET_ENV):
        from moewatch.runtime.sender import Sender  # the runtime's sender: no torch at import

        sender = Sender(environ[SOCKET_ENV], hello).start()
        sinks.append(sender.send_window)
        closers.append(sender.close)
    if environ.get(WINDOW_DIR_ENV):
        sinks.append(DirectorySink(environ[WINDOW_DIR_ENV]))
    return sinks, closers
