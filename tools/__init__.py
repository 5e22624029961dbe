"""moewatch's tools: the demo, the benchmarks, the example-window generator, the synthetic loads and the
EPLB reference port. Only the CLI's `demo`, `bench` and `examples` verbs, the GPU check and the tests import
this package; the sidecar (the agent, `moewatch diagnose`) never does. Torch is reached only by
`tools/bench/probe.py`, `tools/bench/vllm.py` and `tools/balance_ab.py` (through the runtime, on their own
verbs); the demo and the loop bench run the runtime as a subprocess."""
