"""numpy values in JSON: the `default` json.dumps calls for what it cannot encode itself."""

from __future__ import annotations

from typing import Any

import numpy as np


def numpy_default(value: Any) -> Any:
    """A numpy scalar as its Python value, an array as nested lists; TypeError naming anything else
    (json.dumps' contract for `default`)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON: {type(value).__name__}")
