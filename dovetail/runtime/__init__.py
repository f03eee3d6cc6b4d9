"""The Ray runtime: driver, launch, executor, device workers, recovery, publication. It knows no pipeline kind:
what differs by kind it reaches through `kinds.KINDS` and the contract in `runtime.pipeline`."""
