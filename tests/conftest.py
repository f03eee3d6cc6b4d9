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

    from dovetail.exec.launch import start_local_ray

    flag = tmp_path_factory.mktemp("flags") / "nan"
    os.environ["DOVETAIL_TEST_NAN_FLAG"] = str(flag)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    if not ray.is_initialized():
        start_local_ray(cpu_devices=2)
    yield flag
    ray.shutdown()
