"""moewatch's errors, one type per kind of failure:

    MoewatchError
      InputError       bad input (a window, a plan, a file, a size, a source); `field` names it
        ConfigError    bad configuration (the agent's, the runtime's, the thresholds)
        (WindowError, PlanError, PlacementShapeError, FileFormatError, SourceError derive from it)

Every CLI verb turns an InputError into one line on stderr and exit 2 (moewatch/cli_contract.py).
"""

from __future__ import annotations


class MoewatchError(Exception):
    """Anything moewatch refuses on purpose (as opposed to a bug)."""


class InputError(MoewatchError, ValueError):
    """A value broke a contract; `field` names the offending field, and the message starts with it."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


class ConfigError(InputError):
    """Bad configuration. ConfigError(field, message), or ConfigError(message) when the message already
    starts with the field's path ("thresholds: comm_share: ..."); `field` is that path's first part."""

    def __init__(self, field_or_message: str, message: str | None = None):
        if message is None:
            field_name, _, _ = field_or_message.partition(": ")
            self.field = field_name
            ValueError.__init__(self, field_or_message)
        else:
            super().__init__(field_or_message, message)
