"""Every source key cited in the code and docs (`[serving-2026]`) is listed in docs/sources.md, and every
listed key is cited somewhere: a reader can resolve every citation, and the list holds no dead entry."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A key: lower-case words (two characters or more) joined by hyphens, in square brackets, not a Markdown
# link's text nor a character class such as [a-z0-9]. One-word keys ([aurora]) look like code's
# subscripts, so those count only when docs/sources.md lists them.
KEY = re.compile(r"\[([a-z][a-z0-9.]+(?:-[a-z0-9.]{2,})+)\](?!\()")
WORD = re.compile(r"\[([a-z][a-z0-9]+)\](?!\()")


def listed_keys() -> set[str]:
    text = (REPO / "docs" / "sources.md").read_text()
    return set(re.findall(r"^\| `\[([^\]]+)\]`", text, flags=re.M))


def cited_keys() -> dict[str, set[str]]:
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.yml", "*.yaml"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    single_word = {key for key in listed_keys() if "-" not in key}
    cited: dict[str, set[str]] = {}
    for name in files:
        if name == "docs/sources.md" or name.startswith("tests/"):
            continue
        text = (REPO / name).read_text(errors="replace")
        for key in KEY.findall(text) + [w for w in WORD.findall(text) if w in single_word]:
            cited.setdefault(key, set()).add(name)
    return cited


def test_every_cited_source_is_listed():
    listed, cited = listed_keys(), cited_keys()
    assert len(listed) >= 10
    unknown = {key: sorted(files) for key, files in cited.items() if key not in listed}
    assert not unknown, f"cited but not in docs/sources.md: {unknown}"


def test_every_listed_source_is_cited():
    unused = listed_keys() - set(cited_keys())
    assert not unused, f"docs/sources.md lists keys nothing cites: {sorted(unused)}"


def test_the_key_pattern_skips_links_and_finds_keys():
    text = "see [serving-2026], [the docs](x.md), [a-z0-9], x[layer], [aurora] and [vllm-0.32]"
    assert KEY.findall(text) == ["serving-2026", "vllm-0.32"]
    assert WORD.findall(text) == ["layer", "aurora"]
