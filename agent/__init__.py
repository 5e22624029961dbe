"""The moewatch sidecar agent (never imports torch)."""
