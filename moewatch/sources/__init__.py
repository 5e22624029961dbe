"""Readers of other engines' telemetry, turning it into Windows (no torch at import).

- `sglang_dump`: SGLang's expert-distribution recorder dumps (.pt, stat and per_pass modes);
- `sglang_metrics`: SGLang's /metrics heatmap (`sglang:eplb_gpu_physical_count`).

Both are used by `moewatch diagnose` and by the agent, so neither needs to know an engine's format.
"""

from ..errors import InputError


class SourceError(InputError):
    """A foreign file or exposition moewatch cannot use; `field` names the file (or URL) at fault."""
