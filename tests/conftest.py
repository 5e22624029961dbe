"""Suite-wide settings."""

import os

from hypothesis import settings

# CI draws the same examples every run, so a submission's result never depends on which random
# examples a run happened to try; developers' runs keep exploring new ones (and pin what they find
# with @example).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
