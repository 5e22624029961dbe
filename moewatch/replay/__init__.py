"""`moewatch replay`: the operator's recorded windows replayed through each rebalancing policy (the
engines' own, called in the engines' environments, and moewatch's) at several intervals, priced by a
cost model fitted to those windows, ending in a recommendation (docs/eplb-advice.md).

One module per concept:
- trace.py: recorded windows (the plugin's window folder, SGLang's dumps) in time order, shards merged;
- intervals.py: when each interval rebalances, and the load each rebalance is given;
- engine_policies.py: the engines' own policy functions, run in their environments (subprocesses);
- cost_fit.py: step time against the busiest GPU's pairs, fitted to the windows; the migration rate;
- replay.py: maps over time per (policy, interval) -> balancedness, slots and bytes moved, gain, stall, net;
- recommend.py: the choice and the exact engine settings that carry it out;
- report.py and svg.py: the text report, the result file and the picture;
- cli.py: the command.
"""
