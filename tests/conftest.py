import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def local_ray(tmp_path_factory):
    """One local Ray instance for every runtime test, started where its workers can import the tests' own
    modules (a custom reward); yields the file whose existence makes `faulty_reward` return NaN."""
    import ray

    from dovetail.exec.worker import DEVICE_RESOURCE

    flag = tmp_path_factory.mktemp("flags") / "nan"
    os.environ["DOVETAIL_TEST_NAN_FLAG"] = str(flag)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    if not ray.is_initialized():
        ray.init(
            address="local",  # never join a Ray instance already running on this machine
            _node_ip_address="127.0.0.1",
            num_cpus=1,
            resources={DEVICE_RESOURCE: 2},
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    yield flag
    ray.shutdown()
