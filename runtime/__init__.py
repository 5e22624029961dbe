"""The reference expert-parallel runtime and the probe (torch + triton)."""
