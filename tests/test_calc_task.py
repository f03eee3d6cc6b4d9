"""The shipped agentic task, `calc` (dovetail/tasks.py, configs/calc.yaml): its problems are drawn from the seed
alone and answered by the product; its pretraining completions are the very episodes the built-in `arithmetic`
environment plays with the `plain` parser, the environment's part kept out of the loss; its model can read whatever
the calculator answers; its config trains in the reference loop and reports the tool calls."""

import json
import re
from pathlib import Path

import pytest
import torch
from running import train

from dovetail.config.common import ConfigError
from dovetail.config.load import load_config, parse_config
from dovetail.envs.arithmetic import Arithmetic
from dovetail.envs.toolcalls import PARSERS, parse_turn
from dovetail.models.lm import checkpoint_dir, generate, load_lm
from dovetail.models.lm_pretrain import IGNORE, training_batch
from dovetail.models.tokenizer import CharTokenizer
from dovetail.tasks import CALCULATOR_CALL, CALCULATOR_RESULT, Calc, Task, task

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "calc.yaml"
CALC = task("calc")
CALL_END = "</calc>"


def product_of(prompt: str) -> int:
    """The answer, computed here from the prompt text alone."""
    a, b = re.fullmatch(r"calc (\d+)\*(\d+):", prompt).groups()
    return int(a) * int(b)


def test_problems_are_drawn_from_the_seed_alone_and_answered_by_the_product():
    batch = CALC.prompts("train", 3, 5, 16)
    assert batch == CALC.prompts("train", 3, 5, 16) and batch != CALC.prompts("train", 4, 5, 16)
    for prompt in batch + CALC.prompts("eval", 3, 0, 16):
        a, b = re.fullmatch(r"calc (\d+)\*(\d+):", prompt).groups()
        assert all(CALC.min_digits <= len(n) <= CALC.max_digits for n in (a, b))
        assert CALC.episode_row(prompt) == {"question": prompt, "answer": str(product_of(prompt))}
        assert CALC.solution(prompt) == CALC.solution(prompt)  # the tool or not: fixed by the prompt


def play(prompt: str, stage: Task = CALC) -> tuple[list[str], list[str], float]:
    """`stage`'s ideal completion of `prompt` played as an episode of the arithmetic environment: the model's turns
    cut where a call closes, as a rollout stops them; the environment's observations; the reward."""
    environment = Arithmetic(max_turns=3)
    assert environment.reset(CALC.episode_row(prompt)) == prompt
    rest, turns, observations = stage.solution(prompt), [], []
    while True:
        turn = rest[: rest.index(CALL_END) + len(CALL_END)] if CALL_END in rest else rest
        result = environment.step(parse_turn(turn, environment.tools, "plain", len(turns)))
        turns.append(turn)
        if result.done:
            assert turn == rest  # the episode ends where the completion does
            return turns, observations, result.reward
        observations.append(result.observation)
        assert rest[len(turn) :].startswith(result.observation)  # the completion holds what the environment wrote
        rest = rest[len(turn) + len(result.observation) :]


STAGES = [(0.0, 1.0), (CALC.tool_only - 0.01, 1.0), (CALC.tool_only, CALC.tool_share)]
"""(progress through pretraining, the share of its completions that call the tool there)"""


@pytest.mark.parametrize("progress, tool_share", STAGES)
def test_pretraining_completions_are_episodes_the_environment_plays_and_rewards(progress, tool_share):
    """Both stages of pretraining: every completion calls the tool, then `tool_share` of them do."""
    stage = CALC.for_pretraining(progress)
    prompts = stage.prompts("train", 0, 0, 400)
    played = {prompt: play(prompt, stage) for prompt in prompts}
    assert {reward for _, _, reward in played.values()} == {1.0}
    with_tool = [prompt for prompt, (turns, _, _) in played.items() if len(turns) > 1]
    assert abs(len(with_tool) / len(prompts) - tool_share) < 0.07
    for prompt in with_tool:
        turns, observations, _ = played[prompt]
        expression = prompt.removeprefix("calc ").removesuffix(":")
        assert turns[0] == CALCULATOR_CALL.format(expression)
        (call,) = parse_turn(turns[0], Arithmetic().tools, "plain").tool_calls
        assert call.arguments == {"expression": expression}
        assert observations == [CALCULATOR_RESULT.format(product_of(prompt))]
        assert turns[1] == f">{product_of(prompt)}."
    assert PARSERS["plain"].result == CALCULATOR_RESULT.format("{output}")


def test_pretraining_keeps_the_environments_text_out_of_the_loss():
    tokenizer = CharTokenizer(Calc.alphabet)
    prompts = CALC.prompts("train", 0, 0, 40)
    input_ids, labels = training_batch(tokenizer, CALC, prompts)
    for row, prompt in enumerate(prompts):
        turns, observations, _ = play(prompt)
        # what the model writes (its turns and eos) trains; the prompt, the observations and the padding do not
        start = 1 + len(prompt)
        expected = [IGNORE] * start
        for i, turn in enumerate(turns):
            expected += tokenizer.encode(turn)
            if i < len(observations):
                expected += [IGNORE] * len(observations[i])
        expected += [tokenizer.eos_id]
        width = len(expected)
        assert labels[row, :width].tolist() == expected and (labels[row, width:] == IGNORE).all()
        assert tokenizer.decode(input_ids[row, :width]) == prompt + CALC.solution(prompt)


@pytest.mark.parametrize(
    "turn", ["<calc>12*</calc>", "<calc>'a'</calc>", '<calc>"x"+1</calc>', "<calc>7/0</calc>", "<calc>2j</calc>",
             "<calc>x(1)</calc>", "<calc>9**9**9</calc>", "<calc>1+(2</calc>", "<calc>1" + "0" * 1000 + "</calc>"],
)  # fmt: skip
def test_the_model_can_read_whatever_the_calculator_answers(turn):
    environment = Arithmetic()
    environment.reset({"question": "calc 1*1:", "answer": "1"})
    observation = environment.step(parse_turn(turn, environment.tools, "plain")).observation
    assert observation.startswith("<result>error: ")
    CharTokenizer(Calc.alphabet).encode(observation)  # raises on a character outside the model's alphabet


def test_the_shipped_model_calls_the_tool_in_some_first_turns_and_guesses_the_others_wrong():
    torch.set_num_threads(1)
    model, tokenizer, config = load_lm(checkpoint_dir("calc"))
    assert config.task == "calc" and tokenizer.alphabet == Calc.alphabet
    assert 1e6 <= sum(p.numel() for p in model.parameters()) <= 5e6
    prompts = CALC.prompts("eval", 0, 0, 64)
    generator = torch.Generator().manual_seed(0)
    completions = generate(model, tokenizer, prompts, max_new_tokens=24, temperature=1.0, generator=generator)
    first_turns = [tokenizer.decode(ids) for ids in completions]
    calls = [turn.startswith("<calc>") for turn in first_turns]
    assert 0.15 <= sum(calls) / len(prompts) <= 0.6
    guessed = [turn for turn, call in zip(first_turns, calls) if not call]
    right = [turn for turn, prompt in zip(first_turns, prompts) if turn == f">{product_of(prompt)}."]
    assert len(right) <= len(guessed) / 4  # it learned the answer's shape, not the product


def test_the_config_loads_and_a_calc_run_without_its_environment_is_refused_in_one_line():
    config = load_config(CONFIG)
    assert (config.task, config.policy) == ("calc", "reference")
    assert (config.env.name, config.env.parser) == ("arithmetic", "plain")
    assert config.model.checkpoint == checkpoint_dir("calc")
    with pytest.raises(ConfigError) as refused:
        parse_config({"kind": "lm", "task": "calc", "policy": "reference"})
    assert str(refused.value) == (
        "invalid config: env: task calc's problems are episodes of an environment; add env: {name: arithmetic, "
        "parser: plain} (as configs/calc.yaml does)"
    )


def test_a_reference_step_of_the_config_trains_and_reports_the_tool_calls(tmp_path):
    tiny = ["algo.prompts_per_step=2", "algo.group_size=2", "algo.micro_batches=1", "eval.prompts=2"]
    train(load_config(CONFIG, tiny), tmp_path / "run", steps=1)
    (line,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert line["step"] == 1 and 0 <= line["env/tool_calls"] <= 3 and line["env/turns"] >= 1
    assert line["reward/total"] == line["reward/env"] and "eval_reward" in line
