"""SGLang's section of the agent's configuration (`sglang:`): where its windows come from (dumps, /metrics)
and how a plan reaches it (an --init-expert-location file and an optional command)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from moewatch.settings import check_section, setting
from moewatch.thresholds import ConfigError

SECTION = "sglang"


@dataclass(frozen=True)
class SGLangSettings:
    # --- SGLang as a window source (observe and recommend without a probe in SGLang)
    dump_dir: str = setting("", "SGLang's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR: each new expert-distribution "
                                "dump becomes one window (empty: not watched)")
    metrics_url: str = setting("", "SGLang's /metrics URL: sglang:eplb_gpu_physical_count is scraped into windows "
                                   "of per-rank load per layer, one per pair of scrapes; needs sglang.placement_file "
                                   "or sglang.num_experts (empty: not scraped)")
    poll_seconds: float = setting(15.0, "how often the SGLang dump folder is checked and /metrics scraped",
                                  kind=float, lo=0.1, hi=86_400)
    placement_file: str = setting("", "the --init-expert-location JSON SGLang was started with: the placement of "
                                      "the /metrics windows (read at each window; empty: see sglang.num_experts)")
    num_experts: int = setting(0, "logical experts per layer, for SGLang's default placement (slot s holds expert "
                                  "s; no redundant experts) when sglang.placement_file is empty (0: unknown)",
                               kind=int, lo=0, hi=1 << 20)
    model: str = setting("sglang", "model name of the windows read from SGLang (a metric label)")
    ep_group: str = setting("ep0", "EP group name of the windows read from SGLang (a metric label)")
    # --- SGLang as the actuator
    actuate: bool = setting(False, "apply plans to SGLang (write sglang.location_file, then run sglang.command) "
                                   "instead of sending them over the socket", kind=bool)
    location_file: str = setting("", "where the agent writes the expert-location JSON for SGLang")
    command: str = setting("", "command run after writing the file (e.g. a rolling restart); empty: none")
    command_timeout_seconds: float = setting(600.0, "sglang.command is stopped after this long", kind=float,
                                             lo=1, hi=86_400)
    apply_seconds: float = setting(1.8, "what applying a placement costs SGLang, in seconds of stalled serving "
                                        "(about 1.8 s for its rebalance, [measured-stalls]; a restart's time when sglang.command "
                                        "restarts it): the cost gate weighs every plan against it",
                                   kind=float, lo=0, hi=86_400)

    def __post_init__(self) -> None:
        check_section(self, SECTION)
        if self.actuate and not self.location_file:
            raise ConfigError("sglang.location_file: required when sglang.actuate is true")
        if self.metrics_url:
            parsed = urllib.parse.urlsplit(self.metrics_url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ConfigError(f"sglang.metrics_url: expected http://HOST:PORT/metrics, got {self.metrics_url!r}")
            if not self.placement_file and not self.num_experts:
                # The exposition says nothing of the placement, and a window must state it.
                raise ConfigError("sglang.metrics_url: its windows need the placement in force: set "
                                  "sglang.placement_file (the --init-expert-location file) or sglang.num_experts "
                                  "(SGLang's default placement)")
