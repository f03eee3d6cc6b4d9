"""Configs fail early with the field's name; rewards fail loudly with the reward's and sample's name."""

import re
import time

import numpy as np
import pytest
from sklearn.datasets import load_digits
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.common import ConfigError
from dovetail.config.load import load_config
from dovetail.pipelines.flow.config import flow_rules
from dovetail.pipelines.flow.recipe import step_timesteps
from dovetail.rewards import REWARDS, RewardError, score
from dovetail.rewards.judge import digit_probabilities, fit_digit_judge
from dovetail.rewards.text import TextContext, columns_read, score_text, text_reward_fn


def test_yaml_plus_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: dance_grpo\ntrain:\n  lr: 0.001\n")
    config = load_config(path, ["train.lr=1e-4", "algo.group_size=4", "reward.brightness=0.5"])
    assert config.algorithm == "dance_grpo" and flow_rules(config).sde_kind == "dance_grpo"
    assert config.train.lr == 1e-4 and config.algo.group_size == 4
    assert config.reward == {"brightness": 0.5}  # a reward override replaces the default weights


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lr=-1", "train.lr"),
        ("algo.group_size=1", "algo.group_size"),
        ("algorithm=ppo", "algorithm"),
        ("train.learning_rate=1e-4", "train.learning_rate"),
        ("sampling.sde_kind=ddim", "sampling.sde_kind"),
        ("cluster.device=B300", "cluster.device"),
        (
            "runtime.reward_devices=2",
            "runtime.reward_devices=2 must leave devices to generate and train of cluster.devices=2",
        ),
        (
            "runtime.trainer_devices=2",
            "runtime.trainer_devices=2 must leave at least one rollout device of cluster.devices=2",
        ),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert field in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["policy=colocated", "runtime.trainer_devices=1"], "runtime.trainer_devices=1: policy colocated trains on"),
        (["policy=colocated", "runtime.tsp_chunk=2"], "runtime.tsp_chunk=2: policy colocated trains one timestep"),
        (["kind=lm", "policy=verl-sync", "runtime.trainer_devices=1"], "runtime.trainer_devices=1: policy verl-sync"),
    ],
)
def test_a_runtime_field_the_policy_decides_itself_is_refused_under_its_own_name(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(None, overrides)
    load_config(None, [o.replace("colocated", "digen").replace("verl-sync", "streamrl") for o in overrides])


def test_a_negative_adv_eps_is_refused_in_one_line_and_zero_is_taken():
    """The advantages divide by std + adv_eps: a negative eps could make that 0 or negative for a group with spread;
    0 (or -0.0) is TRL's and verl's plain std, a group of equal rewards getting 0 whatever eps."""
    with pytest.raises(ConfigError) as error:
        load_config(None, ["algo.adv_eps=-1e-4"])
    assert str(error.value) == "invalid config: algo.adv_eps: Input should be greater than or equal to 0 (got -0.0001)"
    assert (
        load_config(None, ["algo.adv_eps=0"]).algo.adv_eps == load_config(None, ["algo.adv_eps=-0.0"]).algo.adv_eps == 0
    )


def test_unknown_reward_lists_the_known_ones():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["reward={aesthetic: 1.0}"])
    for name in REWARDS:
        assert name in str(error.value)


def test_override_without_equals_sign_explains_the_form():
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["train.lr"])


def test_digit_match_prefers_the_prompted_digit():
    digits = load_digits()
    images = digits.images[:50] / 16.0
    right = score(images, [f"digit {t}" for t in digits.target[:50]], {"digit_match": 1.0})["digit_match"]
    wrong = score(images, [f"digit {(t + 1) % 10}" for t in digits.target[:50]], {"digit_match": 1.0})["digit_match"]
    assert right.mean() > 0.8 and wrong.mean() < 0.1


def test_shipped_judge_is_the_fit_and_reads_digits(tmp_path):
    """The shipped weights score as `fit_digit_judge`'s regression does, refit here on this machine's BLAS (lbfgs
    stops within its tolerance, so a refit elsewhere may differ in far digits, never in what it reads)."""
    refit = fit_digit_judge(tmp_path / "judge.safetensors")
    digits = load_digits()
    probabilities = digit_probabilities(digits.images / 16.0)
    np.testing.assert_allclose(probabilities, refit.predict_proba(digits.data / 16.0), atol=1e-4)
    assert (probabilities.argmax(axis=1) == digits.target).mean() > 0.99


def test_jpeg_rewards_rank_flat_images_as_compressible():
    flat = np.full((1, 8, 8), 0.5)
    noisy = np.random.default_rng(0).random((1, 8, 8))
    comp = score(
        np.concatenate([flat, noisy]), ["digit 0"] * 2, {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 1.0}
    )
    assert comp["jpeg_compressibility"][0] > comp["jpeg_compressibility"][1]
    np.testing.assert_allclose(comp["jpeg_incompressibility"], -comp["jpeg_compressibility"])
    np.testing.assert_allclose(comp["total"], 0.0)


def test_weighted_total():
    images = np.random.default_rng(1).random((3, 8, 8))
    scores = score(images, ["digit 1"] * 3, {"brightness": 2.0, "digit_match": 0.5})
    np.testing.assert_allclose(scores["total"], 2.0 * scores["brightness"] + 0.5 * scores["digit_match"])


def test_nan_reward_names_the_reward_and_the_sample(monkeypatch):
    def broken(images, prompts):
        values = np.zeros(len(images))
        values[2] = np.nan
        return values

    monkeypatch.setitem(REWARDS, "broken", broken)
    with pytest.raises(RewardError, match=r"'broken'.*sample 2.*digit 3"):
        score(np.zeros((4, 8, 8)), ["digit 0", "digit 1", "digit 3", "digit 4"], {"broken": 1.0})


def test_raising_reward_is_wrapped_with_its_name(monkeypatch):
    def raises(images, prompts):
        raise OSError("judge server down")

    monkeypatch.setitem(REWARDS, "remote", raises)
    with pytest.raises(RewardError, match="'remote' raised OSError: judge server down"):
        score(np.zeros((1, 8, 8)), ["digit 0"], {"remote": 1.0})


def test_a_reward_that_hangs_stops_at_the_timeout_naming_the_setting():
    name = "faulty_reward:waits"  # a request to a reward server that never answers
    start = time.perf_counter()
    with pytest.raises(RewardError, match=rf"^reward '{name}' took longer than reward_timeout_s=0.2 s on 2 samples"):
        score(np.zeros((2, 8, 8)), ["digit 0", "digit 1"], {name: 1.0}, timeout_s=0.2)
    with pytest.raises(RewardError, match=rf"^reward '{name}' took longer than reward_timeout_s=0.1 s on 1 samples"):
        score_text(["1 2"], ["sort: 2 1"], {name: 1.0}, timeout_s=0.1)
    assert time.perf_counter() - start < 30  # stopped, not hung: the bound leaves a slow machine's process starts


@pytest.mark.parametrize(
    ("name", "quick", "slow"),
    [("faulty_reward:backtracks", "aaa", "a" * 27 + "b"), ("faulty_reward:powers", "3", str(2 * 10**7))],
    ids=["regex", "big-integer"],
)
def test_a_reward_holding_the_gil_is_stopped_at_its_timeout_and_the_next_call_runs(name, quick, slow):
    """The slow call is one call into C holding the GIL for many seconds: a thread's timeout would not even see it
    pass, and the call would return its score."""
    assert score_text([quick], ["sort ab:"], {name: 1.0})["total"].tolist() == [1.0]
    start = time.perf_counter()
    with pytest.raises(RewardError) as stopped:
        score_text([slow], ["sort ab:"], {name: 1.0}, timeout_s=1)
    assert time.perf_counter() - start < 10  # at its timeout, not after the call: the raise says it never returned
    assert str(stopped.value) == (
        f"reward '{name}' took longer than reward_timeout_s=1 s on 1 samples and was stopped; make it faster, or raise "
        "reward_timeout_s in the config"
    )
    assert score_text([quick], ["sort ab:"], {name: 1.0})["total"].tolist() == [1.0]  # in a new reward process


@pytest.mark.parametrize(
    ("name", "failure"),
    [
        ("faulty_reward:exits", "raised SystemExit: 0"),
        ("faulty_reward:interrupts", "raised KeyboardInterrupt"),
        ("faulty_reward:ends_its_process", r"ended its process \(exit code 3\); a reward must return its scores"),
    ],
)
def test_a_reward_that_exits_or_interrupts_is_a_reward_failure_and_this_process_goes_on(name, failure):
    with pytest.raises(RewardError, match=rf"^reward '{name}' {failure}"):
        score(np.zeros((2, 8, 8)), ["digit 0", "digit 1"], {name: 1.0})
    with pytest.raises(RewardError, match=rf"^reward '{name}' {failure}"):
        score_text(["1", "2"], ["sort ab:", "sort ba:"], {name: 1.0})


@pytest.mark.parametrize("exit_by", ["exits", "interrupts"])
def test_a_run_whose_reward_exits_fails_in_one_line(exit_by, tmp_path):
    """SystemExit(0) in a reward once ended `dovetail train` with exit code 0, and KeyboardInterrupt in one claimed
    the user's Ctrl-C."""
    lm = ["kind=lm", "task=sort", "algo.prompts_per_step=2", "algo.group_size=2", "eval.prompts=2"]
    overrides = [*lm, "policy=reference", f"reward={{faulty_reward:{exit_by}: 1.0}}"]
    result = CliRunner().invoke(app, ["train", *overrides, "--steps", "1", "--out", str(tmp_path)])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith(f"reward 'faulty_reward:{exit_by}' raised ")


def test_a_reward_in_its_process_scores_as_called_directly(monkeypatch, tmp_path):
    """A user's reward runs in the reward process and sees the caller's environment as it is at the call."""
    images = load_digits().images[:6] / 16.0
    prompts = [f"digit {d}" for d in load_digits().target[:6]]
    name, flag = "faulty_reward:nan_when_flagged", tmp_path / "nan"
    monkeypatch.setenv("DOVETAIL_TEST_NAN_FLAG", str(flag))
    assert np.array_equal(score(images, prompts, {name: 1.0})[name], REWARDS["digit_match"](images, prompts))
    flag.touch()
    with pytest.raises(RewardError, match=rf"^reward '{name}' returned nan for sample 1"):
        score(images, prompts, {name: 1.0})
    monkeypatch.setenv("DOVETAIL_TEST_NAN_FLAG", str(tmp_path / "elsewhere"))
    assert np.array_equal(score(images, prompts, {name: 1.0})[name], REWARDS["digit_match"](images, prompts))
    with pytest.raises(ConfigError, match="reward_timeout_s"):
        load_config(None, ["reward_timeout_s=0"])


@pytest.mark.parametrize("algorithm", ["flow_grpo", "dance_grpo"])
@pytest.mark.parametrize("num_steps", [2, 3, 10, 16])
@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.6, 1.0])
def test_the_planner_counts_the_timesteps_that_training_selects(algorithm, num_steps, fraction):
    """The config's torch-free count (what the simulator plans with) is the trained timesteps' count."""
    config = load_config(
        None, [f"algorithm={algorithm}", f"sampling.num_steps={num_steps}", f"algo.timestep_fraction={fraction}"]
    )
    assert flow_rules(config).trained_timesteps == len(step_timesteps(config, 0)) == len(step_timesteps(config, 7))


@pytest.mark.parametrize("bands", ["[0]", "[8, 4]", "[4, 4]", "[31]", "[5, 100]"])
def test_lm_length_bands_must_lie_inside_the_generation_budget(bands):
    with pytest.raises(ConfigError, match="runtime.length_bands"):
        load_config(None, ["kind=lm", "task=sort", f"runtime.length_bands={bands}"])


def test_lm_length_bands_inside_the_budget_are_taken():
    assert load_config(None, ["kind=lm", "task=sort", "runtime.length_bands=[4, 12]"]).runtime.length_bands == [4, 12]


# --- a user's reward is called as TRL (text) and DDPO / Flow-GRPO (images) call theirs ---------------------------


def trl_correct(prompts, completions, answer, **kwargs):
    """A reward as TRL's docs write them: prompts first, the `answer` column by name, the other columns and the
    completions' token ids in kwargs. Each argument leaves its own mark on the score."""
    return [
        float(c == a) + 10 * len(p) + 100 * len(ids) + 1000 * level
        for p, c, a, ids, level in zip(prompts, completions, answer, kwargs["completion_ids"], kwargs["level"])
    ]


def completions_only(completions, **kwargs):
    return [float(len(c)) for c in completions]


def dovetails_order(completions, prompts):
    return [10.0 * len(p) + len(c) for c, p in zip(completions, prompts)]


def by_position(completions, prompts, /):
    return [0.0] * len(completions)


def needs_answer(prompts, completions, answer):
    return [float(c == a) for c, a in zip(completions, answer)]


def no_completions(prompts):
    return [0.0] * len(prompts)


def swapped_images(prompts, images):
    return [0.0] * len(prompts)


def test_a_reward_written_for_trl_gets_each_argument_by_its_name():
    prompts, completions = ["what is 2+2?", "name a colour:"], ["4", "red"]
    context = TextContext(
        dataset=True, columns={"answer": ["4", "blue"], "level": [1, 2]}, completion_ids=[[7, 2], [5, 6, 2]]
    )
    name = f"{__name__}:trl_correct"
    assert columns_read(name, text_reward_fn(name, dataset=True)) == {"answer"}
    expected = [1.0 + 10 * 12 + 100 * 2 + 1000, 0.0 + 10 * 14 + 100 * 3 + 2000]
    assert score_text(completions, prompts, {name: 1.0}, context=context)[name].tolist() == expected
    # What took (completions, prompts) or named only some arguments goes on working, in a dataset run and a task run.
    for run in (context, TextContext(completion_ids=[[7, 2], [5, 6, 2]])):
        scores = score_text(
            completions, prompts, {f"{__name__}:{f}": 1.0 for f in ("completions_only", "dovetails_order")}, context=run
        )
        assert scores[f"{__name__}:completions_only"].tolist() == [1.0, 3.0]
        assert scores[f"{__name__}:dovetails_order"].tolist() == [121.0, 143.0]


@pytest.mark.parametrize(
    ("function", "says"),
    [
        ("by_position", "takes completions, prompts by position only; rewards are called by keyword, as TRL"),
        ("no_completions", "takes no completions= keyword"),
        ("needs_answer", "requires answer, which a task run does not pass"),
    ],
)
def test_a_text_reward_that_cannot_be_called_by_keyword_is_refused_naming_it_its_file_and_the_fix(function, says):
    name = f"{__name__}:{function}"
    with pytest.raises(ValueError) as error:
        text_reward_fn(name)
    message = str(error.value)
    assert message.startswith(f"reward '{name}' ({__file__}) {says}") and "\n" not in message, message
    assert message.endswith(f": write def {function}(prompts, completions, **kwargs)"), message
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["kind=lm", "task=sort", f"reward={{{name}: 1.0}}"])
    if function == "needs_answer":  # a dataset run passes its columns: the dataset's check (`columns_read`) decides
        assert columns_read(name, text_reward_fn(name, dataset=True)) == {"answer"}


def test_an_image_reward_naming_its_arguments_the_other_way_round_is_refused():
    name = f"{__name__}:swapped_images"
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"reward={{{name}: 1.0}}"])
    assert (
        f"reward '{name}' ({__file__}) takes (prompts, images); an image reward is called f(images, prompts), images "
        "first, as DDPO and Flow-GRPO call theirs: write def swapped_images(images, prompts)"
    ) in str(error.value)
