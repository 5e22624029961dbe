"""Adapters that run inside other engines' processes (vLLM, transformers): routing in, Windows out."""
