#!/usr/bin/env bash
# The sidecar-only install: `pip install .` (no extras, no torch) into a throwaway venv, then
# `moewatch diagnose` and a short `moewatch agent` that must answer /healthz. Reuses pip's cache.
#   run: PYTHON=python3 VENV=/tmp/moewatch-sidecar-check PORT=19477 bash scripts/sidecar_check.sh
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-${TMPDIR:-/tmp}/moewatch-sidecar-check}"
PORT="${PORT:-19477}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "$REPO"
for module in torch matplotlib opentelemetry; do
  if "$VENV/bin/python" -c "import $module" 2>/dev/null; then
    echo "sidecar-check: $module is installed, but the base install must not pull it" >&2
    exit 1
  fi
done
echo "sidecar-check: installed without torch, matplotlib or opentelemetry"

cd "$VENV"
bin/moewatch diagnose "$REPO/examples/imbalance-hot-experts.json" --json \
  | bin/python -c "import json, sys; print('diagnose:', sorted({l['verdict'] for l in json.load(sys.stdin)['layers']}))"

bin/moewatch agent --socket agent.sock --listen "127.0.0.1:$PORT" --log.audit-log audit.jsonl --log.level warning &
agent=$!
healthz="import urllib.request as u; print('agent /healthz:', u.urlopen('http://127.0.0.1:$PORT/healthz').status)"
ok=1
for _ in $(seq 100); do
  if bin/python -c "$healthz" 2>/dev/null; then ok=0; break; fi
  sleep 0.2
done
kill "$agent"
wait "$agent" || true
cd / && rm -rf "$VENV"
exit "$ok"
