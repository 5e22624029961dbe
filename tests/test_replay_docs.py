"""docs/eplb-advice.md's replay excerpt is the text `moewatch replay` renders from the result file it names,
that result file is of the windows committed beside it, and the picture beside it is that result's."""

from __future__ import annotations

import json
import re
from pathlib import Path

from moewatch.planner.files import window_files
from moewatch.replay.report import render_text
from moewatch.replay.svg import picture
from moewatch.replay.trace import inputs_digest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "eplb-advice.md"
BLOCK = re.compile(r"<!-- replay:(?P<path>\S+) -->\n```\n(?P<body>.*?)```\n<!-- /replay -->", re.S)


def test_the_pages_replay_excerpt_is_rendered_from_the_result_file_it_names():
    blocks = list(BLOCK.finditer(PAGE.read_text()))
    assert blocks, "docs/eplb-advice.md has no <!-- replay:FILE --> block"
    for block in blocks:
        result = json.loads((REPO / block["path"]).read_text())
        assert block["body"] == render_text(result), f"re-render {block['path']} into docs/eplb-advice.md"


def test_the_documented_result_is_of_the_committed_windows_and_its_picture():
    folder = REPO / "docs" / "examples" / "replay"
    result = json.loads((folder / "replay.json").read_text())
    assert result["inputs"]["digest"] == inputs_digest(window_files(folder / "windows"))
    assert result["inputs"]["files"] and all(f.startswith("docs/examples/replay/windows/")
                                             for f in result["inputs"]["files"])
    assert (folder / "replay.svg").read_text() == picture(result)
    assert "(examples/replay/replay.svg)" in PAGE.read_text()
