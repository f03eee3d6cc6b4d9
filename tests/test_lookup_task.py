"""The built-in `lookup` environment and its task (dovetail/envs/lookup.py, dovetail/tasks.py: LookupTask,
configs/lookup.yaml): an episode asks about a key whose entry only the environment's table holds (a file of the
user's, or the built-in table hashed from each key), the plain parser reads the lookup's calls, an episode runs reset
-> call -> entry -> answer -> reward the same every time, its rows are drawn from their seed alone, and the task's
pretraining completions are the very episodes the environment plays, its part kept out of the loss; its shipped model
calls the lookup sometimes, with the key, and cannot know an entry; its config trains in the reference loop."""

import hashlib
import json
import string
from pathlib import Path

import pytest
import torch
from running import train

from dovetail.config.load import load_config
from dovetail.envs import make_environment
from dovetail.envs.contract import Latency, MalformedCall, StepResult, ToolCall
from dovetail.envs.episode import Episode
from dovetail.envs.lookup import KeyLookup, builtin_table, lookup_rows
from dovetail.envs.toolcalls import parse_turn
from dovetail.envs.tools import Lookup
from dovetail.graph.node import SampleId
from dovetail.models.lm import checkpoint_dir, generate, load_lm
from dovetail.models.lm_pretrain import IGNORE, training_batch
from dovetail.models.tokenizer import CharTokenizer
from dovetail.tasks import CALCULATOR_RESULT, LOOKUP_CALL, LookupTask, task

LOOKUP = task("lookup")
CALL_END = "</lookup>"
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "lookup.yaml"


def entry_of(key: str, table_seed: int = 0) -> str:
    """The built-in table's entry, computed here from its definition: six digits from a hash of (seed, key)."""
    digest = hashlib.sha256(f"lookup/{table_seed}/{key}".encode()).digest()
    return str(100_000 + int.from_bytes(digest[:8], "big") % 900_000)


def test_the_built_in_table_keys_every_three_letter_string_to_six_digits_of_its_seed():
    table = builtin_table(0)
    assert len(table) == 26**3 and {len(key) for key in table} == {3}
    assert set("".join(table)) == set(string.ascii_lowercase)
    for key in ("aaa", "qxv", "zzz"):
        assert table[key] == entry_of(key) and len(table[key]) == 6
    assert builtin_table(1)["qxv"] == entry_of("qxv", 1) != table["qxv"]
    assert len(set(table.values())) > 0.95 * len(table)  # no entry is guessed from another's


def test_lookup_rows_name_a_key_hold_no_answer_and_are_drawn_from_their_seed_and_index():
    rows = lookup_rows(5, seed=1)
    assert rows == lookup_rows(5, seed=1) != lookup_rows(5, seed=2)
    assert lookup_rows(3, seed=1) == rows[:3]
    for row in rows:
        assert set(row) == {"question", "key"} and row["key"] in builtin_table(0)
        assert row["question"] == f"What is the value of key {row['key']}?"


def lookup_episode(parser: str, **options) -> tuple[Episode, dict]:
    environment = make_environment("lookup", options)
    latency = Latency(kind="constant", seconds=0.25)
    return Episode(environment, "lookup", parser, latency, seed=5, sample=SampleId(1, 2, 3)), lookup_rows(1, seed=3)[0]


def test_a_lookup_episode_runs_reset_call_entry_answer_reward_the_same_every_time():
    plays = []
    for _ in range(2):
        episode, row = lookup_episode("plain", tool_latency={"kind": "constant", "seconds": 0.5})
        key, entry = row["key"], entry_of(row["key"])
        assert episode.reset(row) == row["question"]
        called = episode.step(f"I will look it up: <lookup>{key}</lookup>")
        assert called.result == StepResult(CALCULATOR_RESULT.format(entry)) and called.wait_s == 0.25 + 0.5
        final = episode.step(f">{entry}.")
        assert final.result == StepResult(None, 1.0, True) and final.wait_s == 0.25
        plays.append((called, final))
    assert plays[0] == plays[1]
    wrong, row = lookup_episode("hermes")
    wrong.reset(row)
    call = f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{row["key"]}"}}}}</tool_call>'
    assert wrong.step(call).result.observation == f"<tool_response>\n{entry_of(row['key'])}\n</tool_response>"
    assert wrong.step(f"<answer>{int(entry_of(row['key'])) + 1}</answer>").result == StepResult(None, 0.0, True)


def test_the_plain_parser_reads_lookup_calls_and_the_environment_answers_every_one_in_text():
    environment = KeyLookup()
    environment.reset({"question": "lookup qxv:", "key": "qxv"})
    turn = parse_turn("<lookup>qxv</lookup> <calc>1+1</calc> <lookup>qx", environment.tools, "plain", index=0)
    assert turn.tool_calls == (
        ToolCall("lookup", {"key": "qxv"}),
        MalformedCall("<lookup>qx", "the call is not closed with </lookup>"),
    )  # <calc> is not an offered tool: text, not a call
    observation = environment.step(turn).observation
    assert observation == (
        f"<result>{entry_of('qxv')}</result>\n<result>error: the call is not closed with </lookup></result>"
    )
    missing = environment.step(parse_turn("<lookup>qx</lookup>", environment.tools, "plain", index=1))
    assert missing.observation.startswith("<result>error: no entry 'qx'; close keys: ")
    CharTokenizer(LookupTask.alphabet).encode(missing.observation)  # the task's model reads the tool's errors


def test_an_episode_still_calling_at_its_last_turn_ends_with_no_reward():
    episode, row = lookup_episode("plain", max_turns=2)
    episode.reset(row)
    assert not episode.step(f"<lookup>{row['key']}</lookup>").result.done
    assert episode.step("<lookup>abc</lookup>").result == StepResult(
        CALCULATOR_RESULT.format(entry_of("abc")), 0.0, True
    )


def test_a_table_of_local_data_answers_text_entries_and_a_row_whose_key_it_lacks_is_refused(tmp_path):
    rows = [{"id": "doc1", "title": "Alpha"}, {"id": "doc2", "title": "Beta"}]
    (tmp_path / "docs.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    options = {"table": str(tmp_path / "docs.jsonl"), "key_field": "id", "value_field": "title"}
    environment = make_environment("lookup", options)
    assert environment.reset({"question": "Title of doc2?", "key": "doc2", "answer": "Alpha"}) == "Title of doc2?"
    assert environment.step(parse_turn("<lookup>doc2</lookup>", environment.tools, "plain")).observation == (
        "<result>Beta</result>"
    )  # the row's answer column is not read: the table's entry is the answer
    assert environment.step(parse_turn("<answer>beta</answer>", environment.tools, "plain", 1)).reward == 1.0
    with pytest.raises(ValueError, match=r"^the row's key 'doc3' is not in the lookup table"):
        environment.reset({"question": "?", "key": "doc3"})
    with pytest.raises(ValueError, match=r"^a lookup row has a question and a key column; this one has no key$"):
        environment.reset({"question": "?"})
    with pytest.raises(ValueError, match=r"from a file \(path\) or is given them \(table\): give one$"):
        Lookup()


def play(prompt: str, stage: LookupTask = LOOKUP) -> tuple[list[str], list[str], float]:
    """`stage`'s ideal completion of `prompt` played as an episode of the lookup environment: the model's turns cut
    where a call closes, as a rollout stops them; the environment's observations; the reward."""
    environment = KeyLookup(max_turns=3)
    assert environment.reset(LOOKUP.episode_row(prompt)) == prompt
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


@pytest.mark.parametrize("progress, tool_share", [(0.0, 1.0), (LOOKUP.tool_only, LOOKUP.tool_share)])
def test_pretraining_completions_are_episodes_the_environment_plays_and_rewards(progress, tool_share):
    stage = LOOKUP.for_pretraining(progress)
    prompts = stage.prompts("train", 0, 0, 400)
    played = {prompt: play(prompt, stage) for prompt in prompts}
    assert {reward for _, _, reward in played.values()} == {1.0}
    with_tool = [prompt for prompt, (turns, _, _) in played.items() if len(turns) > 1]
    assert abs(len(with_tool) / len(prompts) - tool_share) < 0.07
    for prompt in with_tool:
        key = prompt.removeprefix("lookup ").removesuffix(":")
        turns, observations, _ = played[prompt]
        assert turns == [LOOKUP_CALL.format(key), f">{entry_of(key)}."]
        assert observations == [CALCULATOR_RESULT.format(entry_of(key))]
    assert LOOKUP.episode_row(prompts[0]).keys() == {"question", "key"}  # the answer is the environment's


def test_pretraining_keeps_the_environments_entries_out_of_the_loss():
    tokenizer = CharTokenizer(LookupTask.alphabet)
    prompts = LOOKUP.for_pretraining(0.0).prompts("train", 0, 0, 16)
    input_ids, labels = training_batch(tokenizer, LOOKUP.for_pretraining(0.0), prompts)
    for row, prompt in enumerate(prompts):
        turns, observations, _ = play(prompt, LOOKUP.for_pretraining(0.0))
        expected = [IGNORE] * (1 + len(prompt)) + tokenizer.encode(turns[0]) + [IGNORE] * len(observations[0])
        expected += [*tokenizer.encode(turns[1]), tokenizer.eos_id]
        assert labels[row, : len(expected)].tolist() == expected


def test_the_config_loads_with_its_environment_and_its_latency():
    config = load_config(CONFIG)
    assert (config.task, config.policy) == ("lookup", "reference")
    assert (config.env.name, config.env.parser, config.env.options) == ("lookup", "plain", {"max_turns": 3})
    assert config.env.latency == Latency(kind="lognormal", median_s=0.02, sigma=0.5)
    assert config.model.checkpoint == checkpoint_dir("lookup")


def test_the_shipped_model_calls_the_lookup_with_the_key_in_some_first_turns_and_guesses_the_others_wrong():
    torch.set_num_threads(1)
    model, tokenizer, config = load_lm(checkpoint_dir("lookup"))
    assert config.task == "lookup" and tokenizer.alphabet == LookupTask.alphabet
    prompts = LOOKUP.prompts("eval", 0, 0, 64)
    generator = torch.Generator().manual_seed(0)
    completions = generate(model, tokenizer, prompts, max_new_tokens=24, temperature=1.0, generator=generator)
    first_turns = [tokenizer.decode(ids) for ids in completions]
    calls = [turn.startswith("<lookup>") for turn in first_turns]
    assert 0.1 <= sum(calls) / len(prompts) <= 0.6
    keyed = [
        turn for turn, prompt in zip(first_turns, prompts) if turn.startswith(LOOKUP_CALL.format(LOOKUP.key(prompt)))
    ]
    assert len(keyed) >= 0.8 * sum(calls)  # a call asks for the prompt's key
    right = [turn for turn, prompt in zip(first_turns, prompts) if turn.startswith(f">{entry_of(LOOKUP.key(prompt))}.")]
    assert not right  # a held-out key's entry is nowhere but in the table


def test_a_reference_step_of_the_config_trains_and_reports_the_lookups(tmp_path):
    tiny = ["algo.prompts_per_step=2", "algo.group_size=2", "algo.micro_batches=1", "eval.prompts=2"]
    train(load_config(CONFIG, tiny), tmp_path / "run", steps=1)
    (line,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert line["step"] == 1 and 0 <= line["env/tool_calls"] <= 3 and line["env/turns"] >= 1
    assert line["reward/total"] == line["reward/env"] and "eval_reward" in line and line["env/wait_s"] > 0
