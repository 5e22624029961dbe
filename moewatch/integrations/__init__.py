"""One room per engine: everything torch-free moewatch knows about an engine (its sources, its
actuator, its settings, what it can apply and at what cost), declared in `base.Integration` and
listed in `registry` (docs/integrations.md). Code that runs inside an engine's process is on the
runtime side, under runtime/engines/."""
