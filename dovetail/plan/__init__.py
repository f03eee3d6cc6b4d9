"""The planner: scenario, prepare, the simulator, the one event loop, cluster state, trace, metrics, report.

Never imports torch or Ray (tests/test_layers.py): planning a 64-GPU run takes seconds on a laptop."""
