"""SGLang's actuator: a Plan becomes an SGLang `--init-expert-location` JSON (`physical_to_logical_map`
[L][P]) written atomically and, when the operator configured one, a command (a rolling restart). It
completes synchronously, so it answers with the Ack itself (status "applied" or "failed"). SGLang
takes a placement only at start or by its own rebalance: not live, no capacity factor, and every
apply costs `apply_seconds` of serving.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ...plan import Plan
from ...planner.files import plan_to_json
from ...wire import Ack
from ..base import PLACEMENT, Actuation, ActuatorProperties, GroupKey

log = logging.getLogger("moewatch.integrations.sglang.actuator")


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class SGLangActuator:
    """Write the expert-location file; optionally run the operator's command (rolling restart).

    Beside the location file (which must hold `physical_to_logical_map` only: SGLang passes its keys
    on as arguments) goes `<name>.moewatch.json` with the plan's epoch, reason and the command's
    outcome, written atomically after it. The command runs once per applied plan: applying the same
    epoch and map again (an agent restarted mid-way, a resend) finds it recorded there and does not
    restart SGLang a second time."""

    name = "sglang"

    def __init__(self, settings: Any):
        """settings: the SGLang section (location_file, command, command_timeout_seconds, apply_seconds)."""
        self.location_file = Path(settings.location_file)
        self.record_file = self.location_file.with_name(self.location_file.name + ".moewatch.json")
        self.command = settings.command
        self.timeout_seconds = settings.command_timeout_seconds
        self.properties = ActuatorProperties(live=False, apply_seconds=float(settings.apply_seconds),
                                             applies=frozenset({PLACEMENT}))

    def applied_record(self) -> dict | None:
        """What the last apply wrote beside the location file (None when nothing readable)."""
        try:
            data = json.loads(self.record_file.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def apply(self, group_key: GroupKey, plan: Plan) -> Actuation:
        location = plan_to_json(plan, "sglang")
        done = self.applied_record()
        if (done and done.get("epoch") == plan.epoch and done.get("ok") and done.get("command") == self.command
                and done.get("physical_to_logical_map_sha256") == _sha(location)):
            return self._done(plan, True, f"epoch {plan.epoch} already applied ({self.record_file})")
        try:
            write_atomically(self.location_file, location + "\n")
        except OSError as exc:
            return self._done(plan, False, f"cannot write {self.location_file}: {exc.strerror}")
        if not self.command:
            return self._record(group_key, plan, location, True, f"wrote {self.location_file}")
        env = {**os.environ, "MOEWATCH_PLAN_FILE": str(self.location_file), "MOEWATCH_PLAN_EPOCH": str(plan.epoch),
               "MOEWATCH_MODEL": group_key[0], "MOEWATCH_EP_GROUP": group_key[1]}
        started = time.monotonic()
        try:
            proc = subprocess.run(shlex.split(self.command), env=env, capture_output=True, text=True,
                                  timeout=self.timeout_seconds)
        except FileNotFoundError:
            return self._record(group_key, plan, location, False, f"command not found: {shlex.split(self.command)[0]}")
        except subprocess.TimeoutExpired:
            return self._record(group_key, plan, location, False, f"command timed out after {self.timeout_seconds:g} s")
        elapsed = time.monotonic() - started
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            return self._record(group_key, plan, location, False, f"command exited {proc.returncode}: {tail[0]}",
                                elapsed)
        return self._record(group_key, plan, location, True,
                            f"wrote {self.location_file}; command ok in {elapsed:.1f} s", elapsed)

    def _record(self, group_key: GroupKey, plan: Plan, location: str, ok: bool, detail: str,
                stall: float = 0.0) -> Actuation:
        record = {"epoch": plan.epoch, "reason": plan.reason, "model": group_key[0], "ep_group": group_key[1],
                  "written_at": time.time(), "location_file": self.location_file.name,
                  "physical_to_logical_map_sha256": _sha(location), "command": self.command, "ok": ok,
                  "detail": detail, "command_seconds": round(stall, 3)}
        try:
            write_atomically(self.record_file, json.dumps(record, allow_nan=False) + "\n")
        except OSError as exc:
            log.error("cannot write %s: %s", self.record_file, exc.strerror)
        return self._done(plan, ok, detail, stall)

    @staticmethod
    def _done(plan: Plan, ok: bool, detail: str, stall: float = 0.0) -> Actuation:
        ack = Ack(plan_epoch=plan.epoch, epoch_in_force=plan.epoch if ok else 0, ok=ok,
                  error="" if ok else detail, stall_seconds=stall,
                  layers_changed=plan.num_layers if ok else 0)
        return Actuation("applied" if ok else "failed", detail, ack)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
