"""moewatch's tools: the demo, the benchmarks, the example-window generator, the synthetic loads and the
EPLB reference port. Only the CLI's `demo`, `bench` and `examples` verbs and the tests import this package;
the sidecar (the agent, `moewatch diagnose`) never does, and `tools/bench/probe.py` and `tools/bench/vllm.py`
are the only modules that reach torch (the runtime), on their own verbs."""
