"""The external tools the suite calls are on PATH (`make system-deps` installs them from Debian): a
missing one fails here, by name, instead of skipping the tests that call it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

# tool -> the Debian package that provides it (Makefile SYSTEM_TOOLS)
TOOLS = {"promtool": "prometheus", "prometheus": "prometheus", "systemd-analyze": "systemd", "openssl": "openssl"}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_tool_is_on_path(tool):
    assert shutil.which(tool), f"{tool} is not on PATH: `make system-deps` installs Debian's {TOOLS[tool]}"


def test_the_makefile_installs_every_tool_the_suite_calls():
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    pairs = re.search(r"^SYSTEM_TOOLS \?= (.+)$", makefile, re.M).group(1).split()
    assert dict(pair.split(":") for pair in pairs) == TOOLS
