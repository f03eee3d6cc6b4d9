"""Rule rewards on text completions: those of the synthetic tasks (dovetail.tasks), those of a user's dataset, and
the call of a user's own.

A task's reward takes the completions and their prompts and returns one float per sample; the task and its answer
are read from the prompt, never stored, so it needs nothing but the two lists. A dataset run's (`prompts.path`)
rewards see the dataset's other columns too: the built-in ones (`DATASET_REWARDS`: answer match against the
`answer` column, a format regex, a length penalty) through a `TextContext`. A user's own ("package.module:function")
is called as TRL's GRPOTrainer calls it, every argument by keyword: `prompts`, `completions`, `completion_ids` and
each other column of the sample's row by its name (only those its signature names, unless it takes **kwargs), so a
reward written for TRL, `def f(prompts, completions, answer, **kwargs)`, gets what TRL would give it. They combine
with weights as the image rewards do: ``{"exact_answer": 1.0, "format": 0.1}``.
"""

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from dovetail.rewards import (
    MODEL_REWARDS,
    REWARD_TIMEOUT_S,
    SERVED_REWARD,
    RewardError,
    RewardRaised,
    RewardSources,
    call_reward,
    custom_reward,
    reward_file,
    reward_values,
    sourced_reward,
)
from dovetail.tasks import Copy, Countdown, ExpressionError, evaluate_expression, final_answer, task_of_prompt

TextRewardFn = Callable[[Sequence[str], Sequence[str]], np.ndarray]

COUNTDOWN_FORMAT_CREDIT = 0.1  # TinyZero's shaping: an expression that evaluates but misses earns a little


def exact_answer(completions: Sequence[str], prompts: Sequence[str]) -> np.ndarray:
    """1 where the final answer (after the last ">", up to ".") solves the prompt's problem, else 0."""
    return np.array([float(_solves(c, p)) for c, p in zip(completions, prompts, strict=True)])


def _solves(completion: str, prompt: str) -> bool:
    answer = final_answer(completion)
    return answer is not None and task_of_prompt(prompt).is_correct(prompt, answer)


def countdown(completions: Sequence[str], prompts: Sequence[str]) -> np.ndarray:
    """1 for a correct expression; COUNTDOWN_FORMAT_CREDIT for one of + - * / on integers that misses the target,
    uses other numbers or divides by zero; 0 for no expression or a disallowed one."""
    scores = []
    for completion, prompt in zip(completions, prompts, strict=True):
        if not isinstance(task_of_prompt(prompt), Countdown):
            raise ValueError(f"the countdown reward scores countdown prompts only, got {prompt!r}")
        answer = final_answer(completion)
        if _solves(completion, prompt):
            scores.append(1.0)
        elif answer is not None and _is_expression(answer):
            scores.append(COUNTDOWN_FORMAT_CREDIT)
        else:
            scores.append(0.0)
    return np.array(scores)


def copied(completions: Sequence[str], prompts: Sequence[str]) -> np.ndarray:
    """The share of the copy prompt's letters written in place before the first slip: |common prefix| / the longer of
    the answer and the text (1 exactly for a correct copy; 0 without an answer). Partial credit, as countdown's: a
    long copy is rarely right whole at first, and a group whose members all score 0 gives GRPO no gradient."""
    scores = []
    for completion, prompt in zip(completions, prompts, strict=True):
        if not isinstance(task_of_prompt(prompt), Copy):
            raise ValueError(f"the copied reward scores copy prompts only, got {prompt!r}")
        answer, text = final_answer(completion), prompt.removeprefix(Copy.prefix).removesuffix(":")
        if answer is None:
            scores.append(0.0)
            continue
        common = next((i for i, (a, b) in enumerate(zip(answer, text)) if a != b), min(len(answer), len(text)))
        scores.append(common / max(len(answer), len(text)))
    return np.array(scores)


def _is_expression(text: str) -> bool:
    """Whether text is + - * / on small integer literals; a division by zero is well formed, merely not correct."""
    try:
        evaluate_expression(text)
    except ExpressionError:
        return False
    except ZeroDivisionError:
        return True
    return True


def format_(completions: Sequence[str], prompts: Sequence[str]) -> np.ndarray:
    """1 where the whole completion has the task's shape (scratchpad, marker, answer, end), right or wrong."""
    return np.array([float(task_of_prompt(p).is_well_formed(c)) for c, p in zip(completions, prompts, strict=True)])


TEXT_REWARDS: dict[str, TextRewardFn] = {
    "exact_answer": exact_answer,
    "countdown": countdown,
    "copied": copied,
    "format": format_,
}
"""The synthetic tasks' rewards: functions of (completions, prompts)."""


DEFAULT_FORMAT = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"
"""The dataset `format` reward's default: DeepSeek-R1's (and TRL's example's) <think>...</think><answer>...</answer>."""


@dataclass(frozen=True)
class TextContext:
    """What a batch's rewards may read besides the completions and their prompts. `dataset`: a `prompts.path` run,
    whose rewards are `DATASET_REWARDS`' and the user's; `columns`: the dataset's other columns, one value per
    sample; `completion_ids`: each response's tokens (a budget of `max_new_tokens`); `format_pattern`: the regular
    expression the dataset `format` reward full-matches."""

    dataset: bool = False
    columns: dict[str, list] = field(default_factory=dict)
    completion_ids: list[list[int]] | None = None
    max_new_tokens: int | None = None
    format_pattern: str = DEFAULT_FORMAT

    def sample(self, i: int) -> "TextContext":
        """The context of sample i alone."""
        return TextContext(
            self.dataset,
            {name: values[i : i + 1] for name, values in self.columns.items()},
            None if self.completion_ids is None else self.completion_ids[i : i + 1],
            self.max_new_tokens,
            self.format_pattern,
        )


BOXED = re.compile(r"\\boxed\s*\{")
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:/\d+)?")
ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str, numeric: bool = False) -> str:
    """The answer a text states, as the usual math graders find it: the last \\boxed{...} (nested braces kept),
    else what follows the last "####" (GSM8K's marker), else the last <answer>...</answer>, else (`numeric`: the
    answer sought is a number) the text's last number, else the whole text."""
    boxed = list(BOXED.finditer(text))
    if boxed:
        start, depth = boxed[-1].end(), 1
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[start:end].strip()
        return text[start:].strip()
    if "####" in text:
        return text.rpartition("####")[2].strip()
    tagged = ANSWER_TAGS.findall(text)
    if tagged:
        return tagged[-1].strip()
    if numeric:
        numbers = NUMBER.findall(text)
        if numbers:
            return numbers[-1]
    return text.strip()


def as_number(text: str) -> Fraction | None:
    """The number a short answer writes ("1,234", "-0.50", "3/4", "$12", "7."), exactly; None if it is no number."""
    cleaned = text.strip().strip("$").replace(",", "").replace(" ", "").rstrip(".")
    cleaned = re.sub(r"^\\frac\{(-?\d+)\}\{(\d+)\}$", r"\1/\2", cleaned)
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)(/\d+)?", cleaned):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(completion: str, answer) -> bool:
    """Whether the completion's answer is the reference `answer` (a dataset cell: its own "####" or \\boxed{} is
    read too): as numbers where both are (1,000 = 1000.0; 0.5 = 1/2), else as text up to case, spacing, surrounding
    $ and a final period."""
    gold = extract_answer(str(answer))
    gold_number = as_number(gold)
    given = extract_answer(completion, numeric=gold_number is not None)
    if gold_number is not None:
        return as_number(given) == gold_number
    return _normalised(given) == _normalised(gold)


def _normalised(text: str) -> str:
    return " ".join(text.strip().strip("$").rstrip(".").casefold().split())


def answer_match(completions: Sequence[str], prompts: Sequence, context: TextContext) -> np.ndarray:
    """1 where the completion's answer (`extract_answer`) is the sample's `answer` column (`answers_match`), else
    0."""
    if "answer" not in context.columns:
        raise ValueError(
            f"answer_match compares with the dataset's `answer` column; its columns are {sorted(context.columns)}"
        )
    answers = context.columns["answer"]
    return np.array([float(answers_match(c, a)) for c, a in zip(completions, answers, strict=True)])


def format_pattern(completions: Sequence[str], prompts: Sequence, context: TextContext) -> np.ndarray:
    """1 where the whole completion matches the run's `format_pattern` (. matching newlines too), else 0."""
    pattern = re.compile(context.format_pattern, re.DOTALL)
    return np.array([float(pattern.fullmatch(c) is not None) for c in completions])


def length_penalty(completions: Sequence[str], prompts: Sequence, context: TextContext) -> np.ndarray:
    """-(response tokens / sampling.max_new_tokens), in [-1, 0]: its weight is what a response of the whole budget
    costs."""
    if context.completion_ids is None or context.max_new_tokens is None:
        raise ValueError("length_penalty needs the responses' token counts")
    return -np.array([len(ids) for ids in context.completion_ids], dtype=np.float64) / context.max_new_tokens


DATASET_REWARDS: dict[str, Callable[[Sequence[str], Sequence, TextContext], np.ndarray]] = {
    "answer_match": answer_match,
    "format": format_pattern,
    "length_penalty": length_penalty,
}
"""The built-in rewards of a dataset run (`prompts.path`): functions of (completions, prompts, `TextContext`)."""


TRL_KEYWORDS = ("prompts", "completions", "completion_ids")
"""What a user's text reward is offered by keyword besides a dataset's columns, as TRL's GRPOTrainer passes them."""


def text_reward_fn(name: str, dataset: bool = False, sources: RewardSources = RewardSources()) -> Callable:
    """A text reward by name: a task's (`TEXT_REWARDS`), or with `dataset` a dataset run's (`DATASET_REWARDS`), a
    model reward's or the `http` one's from `sources` (functions of (completions, prompts)), or your own as
    "package.module:function" (called by keyword as TRL calls it: `_keyword_reward`)."""
    known = DATASET_REWARDS if dataset else TEXT_REWARDS
    if name in known:
        return known[name]
    sourced = sourced_reward(name, sources, "texts")
    if sourced is not None:
        return sourced
    if ":" in name:
        return _keyword_reward(name, custom_reward(name, "(prompts, completions, **kwargs)"), dataset)
    named = [*known, *(n for n, spec in MODEL_REWARDS.items() if spec.scores == "texts"), SERVED_REWARD]
    raise ValueError(f"unknown text reward {name!r}; known text rewards: {sorted(named)}, or give module:function")


def _keyword_reward(name: str, fn: Callable, dataset: bool) -> Callable:
    """`fn` if every argument it needs can be passed by keyword from what a run offers (`TRL_KEYWORDS`, and a dataset
    run's columns, which `columns_read` names for the dataset's check); else a ValueError naming it, its file and
    the signature to write. Refused: a parameter that only position can fill (it was given the completions or the
    prompts by position before, and a TRL reward of (prompts, completions, ...) got them swapped), a function that
    cannot take the completions, and in a task run, which has no columns, any other parameter it requires."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except ValueError:  # no signature to read (some built-ins): its first call tells
        return fn
    attribute = name.partition(":")[2]
    where = f"reward {name!r} ({reward_file(name)})"
    fix = f"write def {attribute}(prompts, completions, **kwargs)"
    by_position = [p.name for p in parameters if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
    if by_position:
        raise ValueError(
            f"{where} takes {', '.join(by_position)} by position only; rewards are called by keyword, as TRL calls "
            f"them: {fix}"
        )
    if not _takes_keyword(parameters, "completions"):
        raise ValueError(f"{where} takes no completions= keyword: {fix}")
    needed = _required_keywords(parameters) - set(TRL_KEYWORDS)
    if needed and not dataset:
        raise ValueError(
            f"{where} requires {', '.join(sorted(needed))}, which a task run does not pass (only "
            f"{', '.join(TRL_KEYWORDS)}): {fix}"
        )
    return fn


def _takes_keyword(parameters, keyword: str) -> bool:
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return keyword in named or any(p.kind == p.VAR_KEYWORD for p in parameters)


def _required_keywords(parameters) -> set[str]:
    """The parameters a call by keyword must fill: those that take a keyword and have no default."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in named and p.default is inspect.Parameter.empty}


def columns_read(name: str, fn: Callable) -> set[str]:
    """The dataset columns a dataset run's reward cannot do without: answer_match's `answer`, a user's function's
    required parameters other than `TRL_KEYWORDS`."""
    if name == "answer_match":
        return {"answer"}
    if ":" not in name:
        return set()
    try:
        parameters = inspect.signature(fn).parameters.values()
    except ValueError:  # no signature to read
        return set()
    return _required_keywords(parameters) - set(TRL_KEYWORDS)


def reward_arguments(name: str, fn: Callable, completions: Sequence[str], prompts: Sequence, context: TextContext):
    """(args, kwargs) of one reward call: a task reward's (completions, prompts) and a built-in dataset reward's
    with its context, by position; a user's by keyword alone, as TRL's GRPOTrainer calls it: `prompts`,
    `completions`, `completion_ids` and the dataset's columns by name (those its signature takes; all where it
    takes **kwargs)."""
    if name in DATASET_REWARDS and context.dataset:
        return (completions, prompts, context), {}
    if ":" not in name:
        return (completions, prompts), {}
    offered = {**context.columns, "prompts": prompts, "completions": completions}
    if context.completion_ids is not None:
        offered["completion_ids"] = context.completion_ids
    try:
        parameters = inspect.signature(fn).parameters.values()
    except ValueError:  # no signature to read: pass everything, as TRL does
        return (), offered
    return (), {k: v for k, v in offered.items() if _takes_keyword(parameters, k)}


def score_text(
    completions: Sequence[str],
    prompts: Sequence,
    weights: dict[str, float],
    timeout_s: float = REWARD_TIMEOUT_S,
    context: TextContext | None = None,
    sources: RewardSources = RewardSources(),
) -> dict[str, np.ndarray]:
    """Each named reward and their weighted sum under "total"; a reward that raises, returns a non-finite value or
    the wrong number of values is a RewardError naming the reward and, where one can be found, the sample.
    `context`: what a dataset run's rewards see besides (`TextContext`); none for a task run. `sources`: what model
    rewards and the `http` one need."""
    context = context or TextContext()
    scores = {}
    for name in weights:
        fn = text_reward_fn(name, context.dataset, sources)
        args, kwargs = reward_arguments(name, fn, completions, prompts, context)
        try:
            output = call_reward(name, fn, args, kwargs, len(completions), timeout_s)
        except RewardRaised as error:
            culprit = _first_raising_sample(name, fn, completions, prompts, timeout_s, context)
            raise RewardError(f"{error}{culprit}") from error
        values = reward_values(name, output, len(completions))
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            i = int(bad[0])
            raise RewardError(
                f"reward {name!r} returned {values[i]} for sample {i} "
                f"(prompt {prompts[i]!r}, completion {completions[i]!r})"
            )
        scores[name] = values
    scores["total"] = sum((weights[name] * scores[name] for name in weights), np.zeros(len(completions)))
    return scores


def _first_raising_sample(
    name: str, fn: Callable, completions: Sequence[str], prompts: Sequence, timeout_s: float, context: TextContext
) -> str:
    """ " on sample i (...)" for the first sample that makes the reward raise on its own; "" if none does alone."""
    for i, (completion, prompt) in enumerate(zip(completions, prompts)):
        try:
            args, kwargs = reward_arguments(name, fn, [completion], [prompt], context.sample(i))
            call_reward(name, fn, args, kwargs, 1, timeout_s)
        except RewardRaised:
            return f" on sample {i} (prompt {prompt!r}, completion {completion!r})"
        except RewardError:  # it overran or ended its process: searching on could take reward_timeout_s each
            return ""
    return ""
