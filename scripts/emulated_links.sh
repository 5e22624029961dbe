#!/usr/bin/env bash
# The reference runtime on emulated links: every rank in its own network namespace, joined to a bridge
# by a veth shaped with tbf to RATE Mbit/s each way (runtime/netlinks.py; `moewatch runtime --link-rate`).
#   scripts/emulated_links.sh RATE_MBIT [moewatch runtime flags...]
#       e.g. scripts/emulated_links.sh 500 --ranks 4 --a2a-schedule aurora --steps 50
#   scripts/emulated_links.sh --cleanup     remove namespaces and veths a killed run left behind
# Needs root and iproute2 (ip, tc); refuses with one line otherwise. Whatever ends the run (its end,
# Ctrl-C, SIGTERM, SIGHUP), the links go: the runtime removes its own, and this script then removes any
# that a dead owner left (names mwl<pid>...; never those of a live process). PYTHON picks the interpreter.
set -uo pipefail
here="${0%/*}"
[ "$here" = "$0" ] && here=.
REPO="$(cd "$here/.." && pwd)"  # bash builtins only up to the checks: they must speak even on a bare PATH
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"

fail() { echo "emulated_links: $*" >&2; exit 2; }
[ "$EUID" -eq 0 ] || fail "needs root (network namespaces, veth and tc)"
for tool in ip tc; do
  command -v "$tool" >/dev/null 2>&1 || fail "needs \`$tool\` (iproute2) on PATH"
done
if [ "${1:-}" = "--cleanup" ]; then
  exec "$PYTHON" -m moewatch.runtime.netlinks cleanup
fi
[ $# -ge 1 ] || fail "usage: scripts/emulated_links.sh RATE_MBIT [moewatch runtime flags...] | --cleanup"
rate="$1"
shift

child=""
leftovers() { "$PYTHON" -m moewatch.runtime.netlinks cleanup >/dev/null 2>&1 || true; }
stop() {
  # Ask the runtime to stop at its next step boundary (it removes its links), then sweep.
  if [ -n "$child" ]; then
    kill -TERM "$child" 2>/dev/null
    wait "$child" 2>/dev/null
  fi
  leftovers
  exit 143
}
trap stop TERM INT HUP
"$PYTHON" -m moewatch.cli runtime --link-rate "$rate" "$@" &
child=$!
wait "$child"
rc=$?
child=""
leftovers
exit "$rc"
