"""The error every contract check raises: what was wrong, and in which field."""

from __future__ import annotations


class FieldError(ValueError):
    """A value broke a contract; `field` names the offending field, and the message starts with it."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")
