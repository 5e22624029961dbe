"""Code that runs inside other engines' processes (vLLM, SGLang, transformers): thin adapters from an
engine's routing to moewatch Windows and the sinks (common.py). Nothing engine-specific lives below them."""
