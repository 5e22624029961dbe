"""Write (or, with --check, compare) what the agent's configuration schema generates: the settings tables
of docs/agent.md (between its `settings:` markers) and the sample file agent/deploy/agent.yaml.

    python scripts/config_docs.py            # rewrite both after a setting changes
    python scripts/config_docs.py --check    # exit 1 naming each stale file
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moewatch.agent.config import sample_config, settings_table

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- settings: begin (generated) -->", "<!-- settings: end -->"


def with_table(docs: str) -> str:
    """docs with the text between the markers replaced by the generated tables."""
    if BEGIN not in docs or END not in docs:
        raise SystemExit(f"the docs lack the markers {BEGIN} ... {END}")
    head, rest = docs.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{settings_table()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when a file is stale")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "agent.md")
    parser.add_argument("--sample", type=Path, default=ROOT / "agent" / "deploy" / "agent.yaml")
    args = parser.parse_args()
    wanted = {args.docs: with_table(args.docs.read_text()), args.sample: sample_config()}
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path}: stale (run scripts/config_docs.py)", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
