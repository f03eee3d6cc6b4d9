"""Rule rewards on the text completions of the synthetic tasks (dovetail.tasks).

Each takes the completions and their prompts and returns one float per sample. The task and its answer are read
from the prompt, never stored, so a reward needs nothing but the two lists. They combine with weights as the
image rewards do: ``{"exact_answer": 1.0, "format": 0.1}``.
"""

from collections.abc import Callable, Sequence

import numpy as np

from dovetail.rewards import REWARD_TIMEOUT_S, RewardError, RewardRaised, call_reward, custom_reward, reward_values
from dovetail.tasks import Countdown, ExpressionError, evaluate_expression, final_answer, task_of_prompt

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


TEXT_REWARDS: dict[str, TextRewardFn] = {"exact_answer": exact_answer, "countdown": countdown, "format": format_}


def text_reward_fn(name: str) -> TextRewardFn:
    """A text reward by name, or your own as "package.module:function" (same signature)."""
    if name in TEXT_REWARDS:
        return TEXT_REWARDS[name]
    if ":" in name:
        return custom_reward(name, "(completions, prompts)")
    raise ValueError(
        f"unknown text reward {name!r}; known text rewards: {sorted(TEXT_REWARDS)}, or give module:function"
    )


def score_text(
    completions: Sequence[str], prompts: Sequence[str], weights: dict[str, float], timeout_s: float = REWARD_TIMEOUT_S
) -> dict[str, np.ndarray]:
    """Each named reward and their weighted sum under "total"; a reward that raises, returns a non-finite value or
    the wrong number of values is a RewardError naming the reward and, where one can be found, the sample."""
    scores = {}
    for name in weights:
        fn = text_reward_fn(name)
        try:
            output = call_reward(name, fn, (completions, prompts), timeout_s)
        except RewardRaised as error:
            culprit = _first_raising_sample(name, fn, completions, prompts, timeout_s)
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
    scores["total"] = sum(weights[name] * scores[name] for name in weights)
    return scores


def _first_raising_sample(
    name: str, fn: TextRewardFn, completions: Sequence[str], prompts: Sequence[str], timeout_s: float
) -> str:
    """ " on sample i (...)" for the first sample that makes the reward raise on its own; "" if none does alone."""
    for i, (completion, prompt) in enumerate(zip(completions, prompts)):
        try:
            call_reward(name, fn, ([completion], [prompt]), timeout_s)
        except RewardRaised:
            return f" on sample {i} (prompt {prompt!r}, completion {completion!r})"
        except RewardError:  # it overran or ended its process: searching on could take reward_timeout_s each
            return ""
    return ""
