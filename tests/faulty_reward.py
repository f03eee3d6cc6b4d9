"""Rewards that fail: NaN while a flag file exists (how the runtime tests break a reward mid-run), and rewards that
run too long holding the GIL, exit, interrupt, end their process or hang."""

import os
import re
import threading

import numpy as np

from dovetail.rewards import digit_match
from dovetail.rewards.text import exact_answer


def nan_when_flagged(images, prompts):
    values = digit_match(images, prompts)
    if os.path.exists(os.environ["DOVETAIL_TEST_NAN_FLAG"]):
        values = values.copy()
        values[1] = np.nan
    return values


def nan_text_when_flagged(completions, prompts):
    """The same for language-model completions: the exact-answer reward, NaN at sample 1 while flagged."""
    values = exact_answer(completions, prompts)
    if os.path.exists(os.environ["DOVETAIL_TEST_NAN_FLAG"]):
        values = values.copy()
        values[1] = np.nan
    return values


def fails_when_flagged(completions, prompts):
    """The exact-answer reward until the flag file exists; then the failure the file names: "holds_the_gil" (the
    backtracking regular expression on 32 "a"s and a "b": one call into C for minutes, longer than any test waits),
    or a function of this module called as the reward ("exits", "ends_its_process"...). A run's reward breaks mid-run
    this way in processes the test cannot reach into (a `dovetail train` subprocess, its Ray workers)."""
    flag = os.environ["DOVETAIL_TEST_NAN_FLAG"]
    if not os.path.exists(flag):
        return exact_answer(completions, prompts)
    failure = open(flag).read().strip()
    if failure == "holds_the_gil":
        return backtracks(["a" * 32 + "b"], prompts[:1])
    return globals()[failure](completions, prompts)


def backtracks(completions, prompts):
    """1 where the completion is all "a"s, by a regular expression that backtracks exponentially on "aa...ab": one
    call into C that holds the GIL for as long as it runs (seconds at 26 "a"s, twice as long with each more)."""
    return np.array([float(re.fullmatch(r"(a+)+", completion) is not None) for completion in completions])


def powers(completions, prompts):
    """The parity of 3 ** n for each completion n: big-integer arithmetic, another long call holding the GIL
    (seconds at n = 10 ** 7)."""
    return np.array([float(pow(3, int(completion)) % 2) for completion in completions])


# The failures below serve as image and as text rewards: they take an image reward's arguments (by position) and a
# text reward's (by keyword) alike.


def exits(*args, **kwargs):
    raise SystemExit(0)


def interrupts(*args, **kwargs):
    raise KeyboardInterrupt


def ends_its_process(*args, **kwargs):
    os._exit(3)


def waits(*args, **kwargs):
    """A request to a reward server that never answers."""
    threading.Event().wait()
