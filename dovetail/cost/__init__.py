"""What work costs: the device and model catalogues, the analytic cost model and its calibration.

The lowest planning layer: `graph` builds nodes with these costs and `sched` plans with them, so nothing here
imports either (nor torch)."""
