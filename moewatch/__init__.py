"""moewatch: observability and auto-tuning for MoE inference with expert parallelism."""

__version__ = "0.1.0"
