"""The learning-rate schedule (`train.lr_schedule`, `train.warmup_steps`): transformers' schedules in closed form,
a function of the optimizer's own step count, so that a restarted optimizer goes on with it."""

import pytest
import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from dovetail.config.common import ConfigError, TrainSection
from dovetail.config.load import load_config
from dovetail.models.training import commit, load_trainer_state, make_optimizer, scheduled_lr, trainer_state_of

TRANSFORMERS = {
    "constant": get_constant_schedule_with_warmup,
    "linear": get_linear_schedule_with_warmup,
    "cosine": get_cosine_schedule_with_warmup,
}


def transformers_lrs(schedule: str, lr: float, steps: int, warmup: int) -> list[float]:
    """The lr transformers' scheduler gives each optimizer step, stepped as TRL's Trainer steps it."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    kwargs = {"num_training_steps": steps} if schedule != "constant" else {}
    scheduler = TRANSFORMERS[schedule](optimizer, num_warmup_steps=warmup, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("steps", "warmup"), [(1, 0), (10, 0), (10, 3), (37, 10), (5, 5)])
def test_each_schedule_is_transformers_schedule_on_the_same_steps(schedule, steps, warmup):
    train = TrainSection(steps=steps, lr=3e-4, lr_schedule=schedule, warmup_steps=warmup)
    ours = [scheduled_lr(train, step) for step in range(steps)]
    assert ours == pytest.approx(transformers_lrs(schedule, 3e-4, steps, warmup), abs=1e-12, rel=0)


def test_commit_steps_at_the_scheduled_lr_and_a_restored_optimizer_goes_on_with_it():
    """Each commit's lr is read back from AdamW's own parameter groups; an optimizer rebuilt from a snapshot taken
    mid-run (as a checkpoint or a restarted trainer holds it) takes the steps the uninterrupted one took."""
    torch.manual_seed(0)
    train = TrainSection(steps=6, lr=1e-2, lr_schedule="cosine", warmup_steps=2)
    model = torch.nn.Linear(3, 2)
    optimizer = make_optimizer(model, train)
    inputs = torch.randn(6, 4, 3)
    lrs, snapshot = [], None
    for step in range(train.steps):
        if step == 3:
            snapshot = trainer_state_of(model, optimizer)
        model(inputs[step]).square().sum().backward()
        commit(model, optimizer, train)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == [scheduled_lr(train, step) for step in range(train.steps)]
    assert lrs[0] == 0.0 and lrs[2] == train.lr and lrs[-1] < train.lr / 5

    restored = torch.nn.Linear(3, 2)
    restored_optimizer = make_optimizer(restored, train)
    load_trainer_state(restored, restored_optimizer, snapshot)
    for step in range(3, train.steps):
        restored(inputs[step]).square().sum().backward()
        commit(restored, restored_optimizer, train)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values()))


def test_the_default_is_a_constant_lr_without_warm_up():
    train = load_config(None, []).train
    assert (train.lr_schedule, train.warmup_steps) == ("constant", 0)
    assert {scheduled_lr(train, step) for step in range(train.steps)} == {train.lr}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.warmup_steps=300", r"train.*warmup_steps=300 is more than steps=200.*lower train.warmup_steps"),
        ("train.lr_schedule=exponential", r"train.lr_schedule.*'constant', 'linear' or 'cosine'"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
