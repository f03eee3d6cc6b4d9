"""Environments and tools (dovetail.envs, docs/environments.md): the sandbox refuses what it must with a clear
observation, the calculator agrees with Python's integers, the tool-call parsers read calls (and what is not one)
written as a chat template teaches them, waits are keyed by who waits, a user's environment loads by its name (a
misnamed one is refused in one line), and an episode of the built-in arithmetic environment runs reset -> tool call
-> observation -> answer -> reward, here and in a process of its own with a time limit."""

import json
import math
import random
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dovetail.config.common import ConfigError
from dovetail.config.load import parse_config
from dovetail.envs import environment_class, make_environment
from dovetail.envs.arithmetic import arithmetic_rows
from dovetail.envs.contract import Latency, MalformedCall, StepResult, ToolCall
from dovetail.envs.episode import EnvironmentFailed, Episode
from dovetail.envs.host import EnvironmentHost
from dovetail.envs.toolcalls import call_tools, parse_turn, render_prompt
from dovetail.envs.tools import Calculator, CalculatorError, Lookup, PythonExecutor, calculate
from dovetail.graph.node import SampleId

# ------------------------------------------------------------------------------------------ the sandbox

SANDBOX = PythonExecutor(cpu_s=1, wall_s=60, memory_mb=128, output_bytes=1000)
"""A wall-clock limit far beyond the CPU one: on a loaded machine (a suite beside other work) 1 s of CPU time took
over 5 s of wall-clock time, and the wall's limit stopped the loop first."""


def python(code: str, tool: PythonExecutor = SANDBOX) -> str:
    return tool(ToolCall("python", {"code": code}))


def test_the_sandbox_runs_code_and_shows_its_last_value_and_its_errors():
    assert python("print('hello')\nsum(range(10))") == "hello\n45"
    assert python("open('notes.txt', 'w').write('kept')\nopen('notes.txt').read()") == "'kept'"
    assert python("import json, math, fractions\nmath.comb(40, 20)") == str(math.comb(40, 20))
    assert python("1/0").endswith("ZeroDivisionError: division by zero")
    assert python("def f(:").endswith("SyntaxError: invalid syntax")


@pytest.mark.parametrize(
    ("code", "says"),
    [
        ("import socket\nsocket.socket()", "error: sandbox: network access is not allowed (socket.__new__)"),
        (
            "import socket\nsocket.create_connection(('127.0.0.1', 80))",
            "error: sandbox: network access is not allowed (socket.getaddrinfo)",
        ),
        (
            "import urllib.request\nurllib.request.urlopen('http://example.com')",
            "error: sandbox: network access is not allowed (socket.getaddrinfo)",
        ),
        (
            "print(open('/etc/passwd').read())",
            "error: sandbox: opening /etc/passwd (outside the scratch directory) is not allowed (open)",
        ),
        (
            "import os\nos.read(os.open('/etc/passwd', os.O_RDONLY), 100)",
            "error: sandbox: opening /etc/passwd (outside the scratch directory) is not allowed (open)",
        ),
        (
            "import os\nos.symlink('/etc/passwd', 'p')",
            "error: sandbox: os.symlink on /etc/passwd (outside the scratch directory) is not allowed (os.symlink)",
        ),
        (
            "import os\nos.listdir('/')",
            "error: sandbox: os.listdir on / (outside the scratch directory) is not allowed (os.listdir)",
        ),
        (
            "import subprocess\nsubprocess.run(['ls'])",
            "error: sandbox: starting a process is not allowed (subprocess.Popen)",
        ),
        ("import os\nos.system('ls')", "error: sandbox: starting a process is not allowed (os.system)"),
        ("import ctypes", "error: sandbox: loading native code is not allowed (ctypes.dlopen)"),
        ("x = bytearray(1 << 30)", "MemoryError: the code went over its memory limit of 128 MB"),
        ("while True:\n    pass", "error: stopped after 1 s of CPU time, its limit"),
    ],
)
def test_the_sandbox_refuses_network_files_processes_memory_and_cpu_each_with_a_clear_observation(code, says):
    assert python(code) == says


def test_the_sandbox_stops_code_at_its_wall_clock_limit_and_cuts_its_output():
    assert python("import time\ntime.sleep(30)", PythonExecutor(wall_s=0.3)) == (
        "error: stopped after 0.3 s of wall-clock time, its limit"
    )
    printed = python("print('x' * 10**7)")
    assert printed == "x" * 1000 + "\n[output cut at 1000 bytes]"
    assert python("open('big', 'w').write('x' * 10**6)", PythonExecutor(file_bytes=4096)) == (
        "error: the code wrote a file past its limit of 4096 bytes"
    )


# ------------------------------------------------------------------------------------------ the calculator


def test_the_calculator_agrees_with_python_integers_of_any_length():
    draw = random.Random(0)
    for _ in range(200):
        a, b, c = (draw.randrange(-(10**40), 10**40) for _ in range(3))
        k = draw.randrange(0, 12)
        assert calculate(f"{a} * {b}") == a * b
        assert calculate(f"({a} - {b}) * {c} + {a}") == (a - b) * c + a
        assert calculate(f"{a} // {b or 1}") == a // (b or 1)
        assert calculate(f"{a} % {b or 1}") == a % (b or 1)
        assert calculate(f"-({a}) ** {k}") == -(a**k)
    assert Calculator()(ToolCall("calc", {"expression": "123456789012 * 987654321098"})) == str(
        123456789012 * 987654321098
    )


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("2 ** 10**6", "2 ** 10 ** 6 has more than 1000 digits"),
        ("10**600 * 10**600", "10 ** 600 * 10 ** 600 has more than 1000 digits"),
        ("1 / 0", "1 / 0 divides by zero"),
        ("1e308 * 10", "1e+308 * 10 is too large for a decimal number"),
        ("(-8) ** 0.5", "(-8) ** 0.5 has no real value"),
        ("__import__('os')", "\"__import__('os')\" is not allowed: numbers, + - * / // % ** and parentheses only"),
        ("12 *", "'12 *' is not an arithmetic expression"),
        ("1+" * 600 + "1", "the expression has 1201 characters; at most 1000"),
    ],
)
def test_the_calculator_refuses_what_it_does_not_compute_in_words(expression, says):
    with pytest.raises(CalculatorError) as refused:
        calculate(expression)
    assert str(refused.value) == says
    assert Calculator()(ToolCall("calc", {"expression": expression})) == f"error: {says}"


def test_a_tool_called_with_the_wrong_arguments_says_which_it_takes():
    assert Calculator()(ToolCall("calc", {"expr": "1+1"})) == (
        'error: calc takes one argument, \'expression\' (a string); got {"expr": "1+1"}'
    )


# ------------------------------------------------------------------------------------------ the lookup


def test_the_lookup_answers_a_key_from_json_or_jsonl_and_names_a_bad_file_and_line(tmp_path):
    (tmp_path / "capitals.json").write_text(json.dumps({"France": "Paris", "Peru": {"capital": "Lima"}}))
    lookup = Lookup(tmp_path / "capitals.json")
    assert lookup(ToolCall("lookup", {"key": " France "})) == "Paris"
    assert lookup.run("Peru") == '{"capital": "Lima"}'
    assert lookup.run("Frence") == "error: no entry 'Frence'; close keys: 'France'"
    rows = [{"id": "doc1", "text": "alpha"}, {"id": "doc2", "text": "beta"}]
    (tmp_path / "docs.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    assert Lookup(tmp_path / "docs.jsonl", key_field="id", value_field="text").run("doc2") == "beta"
    (tmp_path / "bad.jsonl").write_text('{"id": "a"}\n{"id": "a"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: key 'a' again; each key keys one row"):
        Lookup(tmp_path / "bad.jsonl", key_field="id")
    with pytest.raises(ValueError, match=r"missing.json: no such file"):
        Lookup(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------ tool calls

CALC = Calculator()


def test_the_hermes_parser_reads_several_calls_in_order_and_a_malformed_one_as_an_error_to_answer():
    text = (
        'Let me compute. <tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call> and '
        '<tool_call>\n{"name": "calc", "arguments": "{\\"expression\\": \\"2**10\\"}"}\n</tool_call> then '
        '<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}</tool_call> and '
        '<tool_call>{"name": "weather", "arguments": {}}</tool_call><tool_call>{"name": "calc"'
    )
    turn = parse_turn(text, [CALC])
    calls = turn.tool_calls
    assert calls[:2] == (ToolCall("calc", {"expression": "12*34"}), ToolCall("calc", {"expression": "2**10"}))
    assert isinstance(calls[2], MalformedCall) and calls[2].error.startswith("the call is not JSON")
    assert calls[3] == ToolCall("weather", {})
    assert calls[4] == MalformedCall('{"name": "calc"', "the call is not closed with </tool_call>")
    answered = call_tools(turn, [CALC]).split("\n</tool_response>\n")
    assert answered[0] == "<tool_response>\n408" and answered[1] == "<tool_response>\n1024"
    assert answered[2].startswith("<tool_response>\nerror: the call is not JSON (Expecting ',' delimiter")
    assert answered[3] == "<tool_response>\nerror: no tool 'weather'; the tools are calc"
    assert parse_turn("The answer is 408.", [CALC]).tool_calls == ()


def test_the_plain_parser_reads_the_offered_tools_tags_only():
    turn = parse_turn("<calc>12*34</calc> so <answer>408</answer> <calc>1+", [CALC], parser="plain", index=2)
    assert turn.index == 2 and turn.parser == "plain"
    assert turn.tool_calls == (
        ToolCall("calc", {"expression": "12*34"}),
        MalformedCall("<calc>1+", "the call is not closed with </calc>"),
    )
    assert (
        call_tools(turn, [CALC]) == "<result>408</result>\n<result>error: the call is not closed with </calc></result>"
    )


HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call functions.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- \'\\n</tools>\\n\\nFor each call, return <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call>'
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's chat template in small: tools as JSON lines in <tools>, a tool's message in <tool_response>."""


def tiny_tokenizer(template: str) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate("abc")}}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")
    fast.chat_template = template
    return fast


def test_tools_offered_through_a_chat_template_round_trip_to_a_call_and_its_response():
    tokenizer = tiny_tokenizer(HERMES_TEMPLATE)
    tools = [CALC, PythonExecutor()]
    question = [{"role": "user", "content": "What is 12*34?"}]
    prompt = render_prompt(tokenizer, question, [tool.schema() for tool in tools])
    offered = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in offered] == [tool.schema() for tool in tools]
    assert prompt.endswith("<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n")
    completion = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>'
    turn = parse_turn(completion, tools)
    assert turn.tool_calls == (ToolCall("calc", {"expression": "12*34"}),)
    answered = call_tools(turn, tools)
    conversation = [*question, {"role": "assistant", "content": completion}, {"role": "tool", "content": "408"}]
    assert f"<|im_start|>user\n{answered}<|im_end|>" in render_prompt(
        tokenizer, conversation, [tool.schema() for tool in tools]
    )


def test_a_chat_template_that_drops_the_tools_is_refused():
    plain = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="does not write the tools it is given"):
        render_prompt(tiny_tokenizer(plain), [{"role": "user", "content": "hi"}], [CALC.schema()])


# ------------------------------------------------------------------------------------------ latency


def test_a_wait_is_the_same_for_the_same_key_in_any_process_and_lognormal_about_its_median():
    latency = Latency(kind="lognormal", median_s=0.5, sigma=0.8)
    key = (7, 3, 1, 2, 0, "calc")
    assert latency.draw(*key) == latency.draw(*key) != latency.draw(7, 3, 1, 2, 1, "calc")
    program = (
        "from dovetail.envs.contract import Latency; "
        "print(repr(Latency(kind='lognormal', median_s=0.5, sigma=0.8).draw(7, 3, 1, 2, 0, 'calc')))"
    )
    elsewhere = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert float(elsewhere.stdout) == latency.draw(*key)
    waits = [latency.draw(0, step, 0, 0, 0, "env") for step in range(4000)]
    assert statistics.median(waits) == pytest.approx(0.5, rel=0.08)
    assert statistics.stdev(math.log(w) for w in waits) == pytest.approx(0.8, rel=0.08)
    assert Latency(kind="constant", seconds=0.2).draw(*key) == 0.2 and Latency().draw(*key) == 0.0


def test_a_latency_takes_the_fields_of_its_kind():
    with pytest.raises(ValueError, match="median_s and sigma are a lognormal latency's"):
        Latency(kind="constant", seconds=1.0, sigma=0.5)
    with pytest.raises(ValueError, match="a lognormal latency takes median_s and sigma, not seconds"):
        Latency(kind="lognormal", seconds=1.0)


# ------------------------------------------------------------------------------------------ loading an environment

USER_MODULE = '''
from dovetail.envs import Environment, StepResult


class Echo(Environment):
    """Says back each turn; done when the model says stop."""

    def __init__(self, greeting="hello"):
        self.greeting = greeting
        self.heard = []

    def reset(self, row):
        return f"{self.greeting}, {row['name']}"

    def step(self, turn):
        self.heard.append(turn.text)
        done = turn.text == "stop"
        return StepResult(f"heard {len(self.heard)}: {turn.text}", 1.0 if done else None, done)


class Sleepy(Echo):
    def step(self, turn):
        import time

        time.sleep(60)


class Broken(Echo):
    def step(self, turn):
        raise KeyError("no such thing")


class Half(Environment):
    def reset(self, row):
        return ""
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_envs.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_envs"


def test_a_user_environment_loads_by_name_and_keeps_its_episode_state(user_module):
    environment = make_environment(f"{user_module}:Echo", {"greeting": "hi"})
    episode = Episode(environment, "user_envs:Echo", "hermes", Latency(), seed=0, sample=SampleId(0, 0, 0))
    assert episode.reset({"name": "Ada"}) == "hi, Ada"
    assert episode.step("one").result == StepResult("heard 1: one")
    last = episode.step("stop")
    assert last.result == StepResult("heard 2: stop", 1.0, True) and last.turn.index == 1
    with pytest.raises(EnvironmentFailed, match="was stepped after its episode was done"):
        episode.step("more")


@pytest.mark.parametrize(
    ("name", "says"),
    [
        (
            "user_envs:Ecko",
            "environment 'user_envs:Ecko' cannot be imported: AttributeError: module 'user_envs' has no",
        ),
        ("user_envs:Half", "environment 'user_envs:Half' does not define step: an Environment answers reset and step"),
        ("json:dumps", "environment 'json:dumps' is a function, not an Environment: write class dumps("),
        ("echo", "unknown environment 'echo'; use a built-in (arithmetic, lookup) or your own as package.module:Class"),
    ],
)
def test_a_misnamed_environment_is_refused_in_one_line_naming_the_field(user_module, name, says):
    with pytest.raises(ValueError) as refused:
        environment_class(name)
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError) as invalid:
        parse_config({"kind": "lm", "env": {"name": name}})
    assert str(invalid.value).startswith(f"invalid config: env.name: {says}") and "\n" not in str(invalid.value)


def test_a_config_checks_its_environment_options_parser_and_latency(user_module):
    with pytest.raises(ConfigError, match=r"^invalid config: env.options: environment 'user_envs:Echo' does not take"):
        parse_config({"kind": "lm", "env": {"name": "user_envs:Echo", "options": {"volume": 3}}})
    with pytest.raises(ConfigError, match=r"^invalid config: env.parser: unknown tool-call parser 'xml'"):
        parse_config({"kind": "lm", "env": {"name": "user_envs:Echo", "parser": "xml"}})
    config = parse_config(
        {"kind": "lm", "env": {"name": "user_envs:Echo", "latency": {"kind": "constant", "seconds": 1}}}
    )
    assert config.env.latency == Latency(seconds=1.0) and config.rewards == {}  # the environment gives the reward


# ------------------------------------------------------------------------------------------ the arithmetic episode


def arithmetic_episode(parser: str, **options) -> tuple[Episode, dict]:
    row = arithmetic_rows(1, digits=12, seed=3)[0]
    environment = make_environment("arithmetic", options)
    latency = Latency(kind="constant", seconds=0.25)
    return Episode(environment, "arithmetic", parser, latency, seed=5, sample=SampleId(1, 2, 3)), row


def test_an_arithmetic_episode_runs_reset_tool_call_observation_answer_reward():
    episode, row = arithmetic_episode("hermes", tool_latency={"kind": "constant", "seconds": 0.5})
    a, b = map(int, row["question"].removeprefix("What is ").removesuffix("?").split(" * "))
    assert int(row["answer"]) == a * b and len(str(a)) == len(str(b)) == 12
    assert episode.reset(row) == row["question"]
    call = f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{a} * {b}"}}}}</tool_call>'
    stepped = episode.step(call)
    assert stepped.result == StepResult(f"<tool_response>\n{a * b}\n</tool_response>")
    assert stepped.wait_s == 0.25 + 0.5  # the step's own latency and the one call's
    final = episode.step(f"The product is \\boxed{{{a * b}}}.")
    assert final.result == StepResult(None, 1.0, True) and final.wait_s == 0.25
    wrong, row = arithmetic_episode("plain")
    wrong.reset(row)
    assert wrong.step(f"<calc>{a} * {b}</calc>").result.observation == f"<result>{a * b}</result>"
    assert wrong.step(f"<answer>{a * b + 1}</answer>").result == StepResult(None, 0.0, True)


def test_an_arithmetic_episode_still_calling_at_its_last_turn_ends_with_no_reward():
    episode, row = arithmetic_episode("plain", max_turns=2)
    episode.reset(row)
    assert not episode.step("<calc>1+1</calc>").result.done
    assert episode.step("<calc>2+2</calc>").result == StepResult("<result>4</result>", 0.0, True)


def test_arithmetic_rows_are_drawn_from_their_seed_and_index():
    assert arithmetic_rows(3, 5, seed=1) == arithmetic_rows(3, 5, seed=1) != arithmetic_rows(3, 5, seed=2)
    assert arithmetic_rows(5, 5, seed=1)[:3] == arithmetic_rows(3, 5, seed=1)


# ------------------------------------------------------------------------------------------ out of process


def test_episodes_in_their_own_process_keep_state_and_a_hung_step_is_stopped_losing_its_neighbours(user_module):
    host = EnvironmentHost("user_envs:Echo", {}, "hermes", Latency(), seed=0, timeout_s=20)
    try:
        assert host.reset(SampleId(0, 0, 0), {"name": "Ada"}) == "hello, Ada"
        assert host.reset(SampleId(0, 0, 1), {"name": "Bo"}) == "hello, Bo"
        host.step(SampleId(0, 0, 0), "one")
        assert host.step(SampleId(0, 0, 0), "two").result.observation == "heard 2: two"
        host.close(SampleId(0, 0, 1))
        with pytest.raises(EnvironmentFailed, match=r"trajectory \(0, 0, 1\) has no episode: reset it first"):
            host.step(SampleId(0, 0, 1), "one")
    finally:
        host.stop()
    sleepy = EnvironmentHost("user_envs:Sleepy", {}, "hermes", Latency(), seed=0, timeout_s=20)
    try:
        sleepy.reset(SampleId(0, 0, 0), {"name": "Ada"})
        sleepy.reset(SampleId(0, 0, 1), {"name": "Bo"})
        sleepy.timeout_s = 0.5
        with pytest.raises(EnvironmentFailed) as stopped:
            sleepy.step(SampleId(0, 0, 0), "one")
        assert str(stopped.value) == (
            "environment 'user_envs:Sleepy' took longer than timeout_s=0.5 s on trajectory (0, 0, 0) and was stopped"
        )
        with pytest.raises(EnvironmentFailed, match=r"and trajectory \(0, 0, 1\)'s episode, in the same process"):
            sleepy.step(SampleId(0, 0, 1), "one")
        sleepy.timeout_s = 20
        assert sleepy.reset(SampleId(0, 0, 1), {"name": "Bo"}) == "hello, Bo"  # a new process
    finally:
        sleepy.stop()


def test_an_environment_that_raises_is_one_line_naming_it_the_trajectory_and_the_turn(user_module):
    host = EnvironmentHost("user_envs:Broken", {}, "hermes", Latency(), seed=0, timeout_s=20)
    try:
        host.reset(SampleId(4, 5, 6), {"name": "Ada"})
        with pytest.raises(EnvironmentFailed) as raised:
            host.step(SampleId(4, 5, 6), "one")
        assert str(raised.value) == (
            "environment 'user_envs:Broken' raised in step (trajectory (4, 5, 6), turn 0): KeyError: 'no such thing'"
        )
    finally:
        host.stop()


# ------------------------------------------------------------------------------------------ the docs' example

DOC = Path(__file__).resolve().parent.parent / "docs" / "environments.md"


def test_the_example_in_docs_environments_runs_as_written(tmp_path, monkeypatch):
    text = DOC.read_text()
    module = text.split("`my_envs.py`:\n\n```python\n")[1].split("```")[0]
    section = yaml.safe_load(text.split("```yaml\n")[1].split("```")[0])
    (tmp_path / "my_envs.py").write_text(module)
    (tmp_path / "capitals.json").write_text(json.dumps({"France": "Paris", "Peru": "Lima"}))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert parse_config({"kind": "lm", **section}).env.name == "my_envs:Capitals"  # every field of the section checked
    env = section["env"]
    environment = make_environment(env["name"], env["options"])
    episode = Episode(environment, env["name"], env["parser"], Latency(**env["latency"]), 0, SampleId(0, 0, 0))
    assert episode.reset({"country": "Peru", "capital": "Lima"}).startswith("What is the capital of Peru?")
    looked = episode.step('<tool_call>{"name": "lookup", "arguments": {"key": "Peru"}}</tool_call>')
    assert looked.result == StepResult("<tool_response>\nLima\n</tool_response>") and looked.wait_s > 0
    assert episode.step("<answer>Lima</answer>").result == StepResult(None, 1.0, True)
