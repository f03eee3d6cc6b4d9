"""Fault injection (tests/fault_injection.py): DeviceWorker processes SIGKILLed at named moments of a digen run —
during the start-up profile, at a commit, after the last step, two close together, every worker at once. Every run
recovers within the deadline, loses no sample, trains none twice, and ends bitwise equal to an undisturbed run
(the commit sums the train parts' gradients in the order of their keys, wherever they ran)."""

import json

import pytest
import torch
from fault_injection import CONFIG, Fault
from safetensors.torch import load_file

from dovetail.config.train import load_config
from dovetail.train import train

STEPS = 3
pytestmark = pytest.mark.usefixtures("local_ray")


def weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    out = tmp_path_factory.mktemp("undisturbed")
    train(load_config(None, CONFIG), out, steps=STEPS)
    return weights(out)


@pytest.mark.parametrize(
    ("moment", "spread"),
    [
        ("start-up", "one"),
        ("commit", "one"),
        ("commit", "two close"),  # every trainer replica dead by the publish: one is brought back to publish from
        ("last step", "one"),
        ("train", "two close"),
        ("generate", "all"),
    ],
)
def test_killed_workers_recover_and_the_run_is_bitwise_the_undisturbed_one(moment, spread, undisturbed, tmp_path):
    fault = Fault(moment, spread, STEPS)
    summary = train(load_config(None, CONFIG), tmp_path, steps=STEPS, **fault.hooks())
    assert fault.killed and summary["restarts"] >= 1, (fault.killed, summary["restarts"])
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["problems"] == []
    got = weights(tmp_path)
    assert all(torch.equal(got[k], undisturbed[k]) for k in undisturbed)
