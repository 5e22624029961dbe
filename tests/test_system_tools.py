"""The external tools the suite calls are on PATH (`make system-deps` installs them from Debian): a
missing one fails here, by name, instead of skipping the tests that call it."""

from __future__ import annotations

import shutil

import pytest

# tool -> the Debian package that provides it (Makefile SYSTEM_PACKAGES)
TOOLS = {"promtool": "prometheus", "prometheus": "prometheus", "systemd-analyze": "systemd", "openssl": "openssl"}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_tool_is_on_path(tool):
    assert shutil.which(tool), f"{tool} is not on PATH: `make system-deps` installs Debian's {TOOLS[tool]}"
