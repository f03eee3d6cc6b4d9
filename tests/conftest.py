import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DOVETAIL_CACHE", tempfile.mkdtemp(prefix="dovetail-test-cache-"))
"""Start-up profiles and interference tables measured once per test session (`runtime.startup_cache`), not per run,
and never read from a user's cache."""


REPLAYED_FIRST = "test_runtime.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that time the cores (`serial`) run first, those without a Ray instance before those with one:
    nothing else of the session (a Ray instance kept for later tests, its idle processes) shares the cores yet.
    Then the files that run on Ray (a test of theirs uses `local_ray`), the long ones, before the rest: a test file
    stays in one process (`--dist loadfile`), so the short files left at the end even out the two processes. The files
    on a Ray cluster of several nodes (`cluster`) come after those on the local instance, which their process leaves
    to connect to the cluster. Of the files on Ray, `REPLAYED_FIRST` starts: it replays its runs in the simulator
    within 15 %, which a cluster of several nodes loading the other core pushed past once (steps then wait on a driver
    short of CPU, which the simulator does not see); started first, it is done before a cluster file begins."""
    on_ray = {item.path for item in items if "local_ray" in item.fixturenames}
    on_cluster = {item.path for item in items if "cluster" in item.fixturenames}

    def order(item: pytest.Item) -> tuple[bool, bool, bool, bool, bool]:
        serial = item.get_closest_marker("serial") is not None
        later = item.path not in on_ray
        after_replayed = item.path.name != REPLAYED_FIRST
        return (
            not serial,
            serial and "local_ray" in item.fixturenames,
            later and item.path not in on_cluster,
            later,
            after_replayed,
        )

    items.sort(key=order)  # stable: every other test keeps its place


@pytest.fixture(scope="session")
def local_ray(tmp_path_factory):
    """One local Ray instance for every runtime test, started where its workers can import the tests' own
    modules (a custom reward); yields the file whose existence makes `faulty_reward` return NaN."""
    import ray

    from dovetail.runtime.ray_start import start_local_ray

    flag = tmp_path_factory.mktemp("flags") / "nan"
    os.environ["DOVETAIL_TEST_NAN_FLAG"] = str(flag)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    if not ray.is_initialized():
        start_local_ray(cpu_devices=2)
    yield flag
    ray.shutdown()


@pytest.fixture(scope="session")
def sd3_pipeline_dir(tmp_path_factory) -> Path:
    """A tiny random-init StableDiffusion3Pipeline saved with save_pretrained (`tiny_pipelines.tiny_sd3_pipeline`),
    built once per test process: what a user gives as `model.path`."""
    from tiny_pipelines import tiny_sd3_pipeline

    return tiny_sd3_pipeline(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def tiny_prompts_file(tmp_path_factory) -> Path:
    """A text file of `tiny_pipelines.PROMPTS`, one a line: prompts the tiny pipelines' tokenizers spell."""
    from tiny_pipelines import PROMPTS

    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def train_until_the_reward_breaks(flag: Path, config, pipeline: str, steps: int, out: Path) -> tuple[str, int, str]:
    """Train `config` (its reward `faulty_reward`, NaN while `flag` exists) for `steps`, the flag raised once the
    pipeline's first step is committed; the run must stop on a RewardError with exactly one checkpoint. Returns the
    checkpoint's name, the steps committed (metrics lines) and the error's message."""
    from running import train

    from dovetail.rewards import RewardError

    def break_reward_once_a_step_is_committed(executor, part):
        if executor.committed_steps(pipeline):
            flag.touch()

    try:
        with pytest.raises(RewardError) as stopped:
            train(config, out, steps=steps, after_part=break_reward_once_a_step_is_committed)
    finally:
        flag.unlink(missing_ok=True)
    (saved,) = (out / "checkpoints").iterdir()
    return saved.name, len((out / "metrics.jsonl").read_text().splitlines()), str(stopped.value)
