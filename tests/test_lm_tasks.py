"""The tiny language model's tokenizer, tasks, text rewards and shipped checkpoint."""

import hashlib
import json
import os
import random
import re
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from dovetail.models.lm import LMConfig, checkpoint_dir, load_lm
from dovetail.models.lm_pretrain import evaluate, pretrain_lm
from dovetail.models.tokenizer import CharTokenizer
from dovetail.rewards import RewardError
from dovetail.rewards.text import COUNTDOWN_FORMAT_CREDIT, copied, countdown, exact_answer, score_text, text_reward_fn
from dovetail.tasks import TASKS, ExpressionError, evaluate_expression, final_answer, split_of, task

SHIPPED_TASK = "sort"
SHIPPED_SUCCESS_BAND = (0.2, 0.6)  # temperature-1 held-out success the shipped base model is made to have


def many_prompts(name: str, count: int = 150) -> list[str]:
    return [TASKS[name].prompt(split, seed, i) for split in ("train", "eval") for seed in (0, 1) for i in range(count)]


def test_tokenizer_round_trip_and_specials(tmp_path):
    tokenizer = CharTokenizer()
    text = tokenizer.alphabet[::-1] + "add 12+345:"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert set(ids) <= set(range(3, tokenizer.vocab_size))
    assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id, tokenizer.pad_id]) == text
    tokenizer.save(tmp_path)
    loaded = CharTokenizer.load(tmp_path)
    assert (loaded.alphabet, loaded.encode(text)) == (tokenizer.alphabet, ids)


def test_tokenizer_names_unknown_characters_and_the_alphabet():
    with pytest.raises(ValueError, match=r"\['#', 'Q'\].*alphabet '0123456789"):
        CharTokenizer().encode("sort 1,Q#,Q:")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_solution_is_correct_well_formed_and_fits(name):
    the_task, tokenizer = task(name), CharTokenizer()
    prompts = many_prompts(name)
    solutions = [the_task.solution(p) for p in prompts]
    for reward in {"exact_answer", "format", *the_task.reward_names}:
        assert text_reward_fn(reward)(solutions, prompts).tolist() == [1.0] * len(prompts), reward
    assert max(len(tokenizer.encode(s)) for s in solutions) + 1 <= the_task.max_new_tokens  # eos included
    longest_prompt = max(len(tokenizer.encode(p)) for p in prompts)
    positions = LMConfig(task=name, vocab_size=tokenizer.vocab_size).max_positions
    assert 1 + longest_prompt + the_task.max_new_tokens <= positions  # bos, prompt, completion


def independent_answer(prompt: str) -> str:
    """The expected final answer, computed here from the prompt text alone."""
    if prompt.startswith("add "):
        a, b = re.fullmatch(r"add (\d+)\+(\d+):", prompt).groups()
        return str(int(a) + int(b))
    if prompt.startswith("copy "):
        return prompt.removeprefix("copy ").removesuffix(":")
    if prompt.startswith("calc "):
        a, b = re.fullmatch(r"calc (\d+)\*(\d+):", prompt).groups()
        return str(int(a) * int(b))
    if prompt.startswith("lookup "):  # the built-in table's entry: six digits hashed from (table seed 0, key)
        key = re.fullmatch(r"lookup ([a-z]{3}):", prompt).group(1)
        return str(100_000 + int.from_bytes(hashlib.sha256(f"lookup/0/{key}".encode()).digest()[:8], "big") % 900_000)
    letters = re.fullmatch(r"sort ([a-z]+):", prompt).group(1)
    return "".join(sorted(letters))


@pytest.mark.parametrize("name", ["arithmetic", "sort", "copy", "calc", "lookup"])
def test_solutions_end_in_the_independently_computed_answer_and_wrong_answers_score_zero(name):
    prompts = many_prompts(name)
    assert [final_answer(task(name).solution(p)) for p in prompts] == [independent_answer(p) for p in prompts]
    wrong = [f">{independent_answer(p)}1." for p in prompts]
    assert exact_answer(wrong, prompts).tolist() == [0.0] * len(prompts)
    truncated = [task(name).solution(p)[:-1] for p in prompts]  # no end marker: cut at max_new_tokens
    assert exact_answer(truncated, prompts).tolist() == [0.0] * len(prompts)


def test_addition_scratchpad_length_follows_the_longer_operand():
    solution = task("arithmetic").solution("add 57+968:")
    assert solution == "7+8+0=15,5+6+1=12,0+9+1=10>1025."
    assert task("arithmetic").solution("add 5+4:") == "5+4+0=9>9."


def test_countdown_solutions_are_valid_steps_using_every_number_once():
    for prompt in many_prompts("countdown", 60):
        target, numbers = re.fullmatch(r"make (\d+) from ([\d,]+):", prompt).groups()
        pool = sorted(int(n) for n in numbers.split(","))
        steps = final_answer_steps(task("countdown").solution(prompt))
        for a, op, b, result in steps:
            expected = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
            assert expected == result > 0
            pool.remove(a)
            pool.remove(b)
            pool.append(result)
        assert pool == [int(target)]


def final_answer_steps(solution: str) -> list[tuple[int, str, int, int]]:
    steps = solution.partition(">")[0].split(",")
    parsed = [re.fullmatch(r"(\d+)([-+*/])(\d+)=(\d+)", step).groups() for step in steps]
    return [(int(a), op, int(b), int(result)) for a, op, b, result in parsed]


def test_countdown_reward_gives_partial_credit_to_well_formed_misses():
    prompt = "make 22 from 3,5,7:"
    completions = {
        "3*5=15,15+7=22>(3*5)+7.": 1.0,
        ">7+3*5.": 1.0,  # the steps are optional; the expression is what is checked
        ">(3*5)+8.": COUNTDOWN_FORMAT_CREDIT,  # wrong numbers
        ">3*5+7+1.": COUNTDOWN_FORMAT_CREDIT,  # an extra number, even though it reaches 23 - 1
        ">(3+5)*7.": COUNTDOWN_FORMAT_CREDIT,  # wrong value
        ">3/(5-5)+7.": COUNTDOWN_FORMAT_CREDIT,  # division by zero: not correct, still an expression
        ">abs(3)+5*7.": 0.0,
        "(3*5)+7.": 0.0,  # no answer marker
        ">(3*5)+7": 0.0,  # no end marker
    }
    scores = countdown(list(completions), [prompt] * len(completions))
    assert dict(zip(completions, scores.tolist())) == completions
    assert exact_answer(list(completions), [prompt] * len(completions)).tolist() == [
        float(v == 1.0) for v in completions.values()
    ]
    with pytest.raises(ValueError, match="countdown prompts only"):
        countdown([">ab."], ["sort ba:"])


@pytest.mark.parametrize(
    "text",
    ["x+1", "abs(3)", "(3).real", "2**3", "-3+5", "1.5*2", "'a'", "3<4", "True", "[1][0]", "3 if 1 else 2", "3;4"],
)
def test_expression_walker_rejects_everything_but_integer_arithmetic(text):
    with pytest.raises(ExpressionError):
        evaluate_expression(text)


def test_expression_walker_rejects_huge_literals_magnitudes_and_sizes():
    for text in ["100001+1", "9999*9999*9999*9999", "1" + "+1" * 40, "(" * 150 + "1" + ")" * 150]:
        with pytest.raises(ExpressionError):
            evaluate_expression(text)
    with pytest.raises(ZeroDivisionError):
        evaluate_expression("7/(3-3)")


def random_expression(rng: random.Random, depth: int) -> tuple[str, Fraction]:
    """A fully bracketed expression and its value, computed here without the walker."""
    if depth == 0 or rng.random() < 0.3:
        value = rng.randint(1, 50)
        return str(value), Fraction(value)
    (left, a), (right, b) = random_expression(rng, depth - 1), random_expression(rng, depth - 1)
    op = rng.choice("+-*/")
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
    return f"({left}{op}{right})", value


def test_expression_walker_computes_exactly():
    assert evaluate_expression("2+3*4").value == 14
    assert evaluate_expression("10-2-3").value == 5  # left associative
    assert evaluate_expression("8/4/2").value == 1
    assert evaluate_expression("7/2").value == Fraction(7, 2)
    assert evaluate_expression("(12*16)+(10+19)").literals == (12, 16, 10, 19)
    rng = random.Random(0)
    for _ in range(300):
        text, value = random_expression(rng, 3)
        assert evaluate_expression(text).value == value, text


@pytest.mark.parametrize("name", sorted(TASKS))
def test_train_and_eval_never_share_a_problem(name):
    the_task = task(name)
    train = {the_task.prompt("train", seed, i) for seed in range(3) for i in range(700)}
    held_out = {the_task.prompt("eval", seed, i) for seed in range(3) for i in range(700)}
    assert not train & held_out
    assert {split_of(p) for p in train} == {"train"} and {split_of(p) for p in held_out} == {"eval"}
    drawn = [split_of(the_task.draw(random.Random(i))) for i in range(3000)]
    assert 0.06 < drawn.count("eval") / len(drawn) < 0.14  # one in ten held out


def test_prompts_are_a_pure_function_of_their_arguments():
    the_task = task("arithmetic")
    batch = the_task.prompts("train", 3, 5, 8)
    assert batch == the_task.prompts("train", 3, 5, 8) == [the_task.prompt("train", 3, 40 + i) for i in range(8)]
    assert batch != the_task.prompts("train", 3, 6, 8) and batch != the_task.prompts("train", 4, 5, 8)
    script = "from dovetail.tasks import TASKS; print([t.prompts('eval', 3, 5, 8) for t in TASKS.values()])"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    other_process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert other_process.stdout.strip() == str([t.prompts("eval", 3, 5, 8) for t in TASKS.values()])
    with pytest.raises(ValueError, match="unknown split 'test'"):
        the_task.prompt("test", 0, 0)


def test_unknown_task_and_reward_are_named():
    with pytest.raises(
        ValueError,
        match=r"unknown task 'chess'; known tasks: \['arithmetic', 'calc', 'copy', 'countdown', 'lookup', 'sort'\]",
    ):
        task("chess")
    with pytest.raises(ValueError, match=r"unknown text reward 'length'.*'exact_answer'"):
        text_reward_fn("length")


def raises_on_sort_prompts(completions, prompts):
    return np.array([1.0 / (not p.startswith("sort ")) for p in prompts])


def nan_on_second(completions, prompts):
    return np.array([np.nan if i == 1 else 1.0 for i in range(len(prompts))])


def test_a_failing_custom_reward_is_a_reward_error_naming_it_and_the_sample():
    prompts, completions = ["add 1+2:", "sort ca:", "add 4+5:"], [">3.", ">ac.", ">9."]
    weights = {"exact_answer": 1.0, "format": 0.5}
    scores = score_text(completions, prompts, weights)
    assert scores["total"].tolist() == [1.0, 1.5, 1.0]  # ">3." is right but skips the addition's scratchpad
    name = f"{__name__}:raises_on_sort_prompts"
    with pytest.raises(RewardError, match=rf"{name}.*ZeroDivisionError.*sample 1 \(prompt 'sort ca:'"):
        score_text(completions, prompts, {name: 1.0})
    name = f"{__name__}:nan_on_second"
    with pytest.raises(RewardError, match=rf"{name}.*nan for sample 1 \(prompt 'sort ca:'"):
        score_text(completions, prompts, {name: 1.0})


def test_missing_checkpoint_is_one_line_naming_the_directory_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_lm(tmp_path / "sort-lm")
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "sort-lm") in message and "dovetail pretrain sort" in message


def test_unreadable_config_is_one_line(tmp_path):
    shipped = checkpoint_dir(SHIPPED_TASK)
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((shipped / name).read_bytes())
    for text in ("{not json", json.dumps({"task": "sort", "vocab_size": 53, "depth": 3})):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ValueError, match="unreadable") as error:
            load_lm(tmp_path)
        assert "\n" not in str(error.value)


def test_copied_credits_the_letters_written_before_the_first_slip():
    completions = [">abcd.", ">abxd.", ">ab.", ">abcde.", ">xbcd.", "abcd", ">abcd"]
    assert copied(completions, ["copy abcd:"] * 7).tolist() == [1.0, 0.5, 0.5, 0.8, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="copy prompts only"):
        copied([">ab."], ["sort ba:"])


def test_copy_responses_have_a_heavy_tail():
    """The copy task's ideal responses (eos included) are lognormal-like: p99 / p50 >= 8, as in published RL traces
    of reasoning models, where sort's 3-31 tokens are near-uniform."""
    tokenizer, copy = CharTokenizer(), task("copy")
    lengths = np.array([len(tokenizer.encode(copy.solution(p))) + 1 for p in copy.prompts("train", 0, 0, 4000)])
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p99 / p50 >= 8, (p50, p99)


def test_pretraining_is_deterministic_given_the_seed(tmp_path, capsys):
    torch.set_num_threads(1)
    tiny = LMConfig(task="sort", vocab_size=CharTokenizer().vocab_size, hidden=32, layers=1, heads=2, kv_heads=2,
                    intermediate=64)  # fmt: skip
    for run in ("a", "b"):
        pretrain_lm("sort", tmp_path / run, steps=3, seed=7, batch_size=4, eval_count=4, config=tiny)
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()
    assert capsys.readouterr().out.count("held-out success at temperature") == 4
    loaded, _, config = load_lm(tmp_path / "a")
    assert config == tiny and not loaded.training


def test_shipped_model_samples_within_its_band_and_greedy_does_better():
    torch.set_num_threads(1)
    model, tokenizer, config = load_lm(checkpoint_dir(SHIPPED_TASK))
    assert config.task == SHIPPED_TASK and not model.training
    assert 1e6 <= sum(p.numel() for p in model.parameters()) <= 5e6
    sampled = evaluate(model, tokenizer, task(SHIPPED_TASK), count=48, temperature=1.0, seed=0)
    greedy = evaluate(model, tokenizer, task(SHIPPED_TASK), count=48, temperature=0.0)
    low, high = SHIPPED_SUCCESS_BAND
    assert low <= sampled.success <= high
    assert greedy.success >= sampled.success + 0.1
