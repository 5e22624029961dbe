#!/usr/bin/env bash
# The reference runtime's step latency while its agent is SIGKILLed and restarted (issue 11).
#   run: bash scripts/agent_restart_p99.sh SCENARIO [FOLDER]     SCENARIO: up | kill | control
# up: the agent runs all along, the runtime (2 ranks, 40 s) connected. kill: the agent is SIGKILLed
# 6 s after the runtime's first window and restarted 3 s later. control: the same kill and restart
# of an agent the runtime is not connected to (what CPU contention alone does). Prints the run's
# p50/p99 and, for kill and control, the p99 of the steps from 1 s before the kill to 8 s after
# the restart against the rest of the same run (rank 0's per-step times, from the windows file).
set -u
S=${1:?up, kill or control}; D=${2:-/tmp/moewatch-restart-$S}; PY=${PY:-python3}
rm -rf "$D"; mkdir -p "$D"
agent() { $PY -m moewatch.cli agent --socket "$D/a.sock" --listen 127.0.0.1:0 --log.audit-log "$D/audit.jsonl" \
  --log.level info 2>>"$D/agent.log" & echo $! > "$D/agent.pid"; }
agent
sleep 3
SOCK=(--socket "$D/a.sock"); [ "$S" = control ] && SOCK=()
$PY -m moewatch.cli runtime --ranks 2 --steps 0 --seconds 40 --json "${SOCK[@]}" --windows-out "$D/windows.jsonl" \
  > "$D/runtime.json" 2>"$D/runtime.log" &
RT=$!
if [ "$S" != up ]; then
  while [ ! -s "$D/windows.jsonl" ]; do sleep 0.2; done
  sleep 6
  kill -9 "$(cat "$D/agent.pid")"; echo "killed $(date +%s.%N)" >> "$D/events"
  sleep 3
  agent; echo "restarted $(date +%s.%N)" >> "$D/events"
fi
wait $RT
kill "$(cat "$D/agent.pid")" 2>/dev/null; wait 2>/dev/null
$PY - "$S" "$D" <<'PY'
import json, sys
import numpy as np
s, d = sys.argv[1:]
r = json.load(open(f"{d}/runtime.json"))
sender = r["sender"] and {k: r["sender"][k] for k in ("connects", "connect_failures", "disconnects", "frames_dropped")}
print(f"{s}: p50 {r['step_p50_s'] * 1e3:.1f} ms, p99 {r['step_p99_s'] * 1e3:.1f} ms over {r['measured_steps']} steps; "
      f"sender {sender}")
if s != "up":
    ev = dict(line.split() for line in open(f"{d}/events"))
    killed, restarted = float(ev["killed"]), float(ev["restarted"])
    steps = np.array([(t, x) for w in map(json.loads, open(f"{d}/windows.jsonl"))
                      for t, x in zip(np.linspace(w["start_time"], w["end_time"], len(w["step_seconds"])),
                                      w["step_seconds"])])
    near = (steps[:, 0] > killed - 1) & (steps[:, 0] < restarted + 8)
    print(f"  steps near the kill and restart: p99 {np.percentile(steps[near, 1], 99) * 1e3:.1f} ms "
          f"({near.sum()} steps); the rest of the run: p99 {np.percentile(steps[~near, 1], 99) * 1e3:.1f} ms")
PY
