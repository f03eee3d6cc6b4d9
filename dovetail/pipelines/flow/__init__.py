"""Flow-matching image / video pipelines (FlowGRPO, DanceGRPO): everything that is a flow pipeline's alone."""
