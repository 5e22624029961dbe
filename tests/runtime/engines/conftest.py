"""The engine tests share tiny_models.py and vllm_driver.py, which live beside them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
