"""How a model writes tool calls and reads their results: the conventions (`PARSERS`, by the name `env.parser`
gives), the tools offered in a prompt through the model's own chat template (`render_prompt`), and a turn's calls
answered (`call_tools`).

* `hermes`: the Hermes / Qwen convention, which Qwen2.5, Qwen3, Hermes and most tool-calling chat templates teach:
  each call is ``<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>``, several per turn
  allowed; each result comes back as ``<tool_response>408</tool_response>``, as those templates write a tool's
  message.
* `plain`: for our tiny models, which know no JSON: a call is the tool's name as a tag around its one argument,
  ``<calc>12*34</calc>``; its result ``<result>408</result>``. Only the names of the tools offered are read as
  calls, so other tags (``<answer>``) stay text.

A call that cannot be read (not JSON, no name, a tag left open) is a `MalformedCall`, answered with what is wrong:
never an exception."""

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dovetail.envs.contract import MalformedCall, StepResult, Tool, ToolCall, Turn
from dovetail.rewards.text import answers_match

Call = ToolCall | MalformedCall

HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str, tools: Sequence[Tool]) -> tuple[Call, ...]:
    """Every <tool_call>...</tool_call> of the text, in order (one left open at the end is malformed: the turn
    stopped inside it)."""
    calls: list[Call] = []
    for match in HERMES_CALL.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            calls.append(MalformedCall(body, "the call is not closed with </tool_call>"))
            continue
        calls.append(_hermes_call(body))
    return tuple(calls)


def _hermes_call(body: str) -> Call:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return MalformedCall(body, f"the call is not JSON ({error.msg} at character {error.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return MalformedCall(body, 'the call is not {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API sends them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return MalformedCall(body, "the call's arguments are not a JSON object")
    return ToolCall(call["name"], arguments)


def parse_plain(text: str, tools: Sequence[Tool]) -> tuple[Call, ...]:
    """Every <name>argument</name> of the text whose name is an offered tool's, in order."""
    if not tools:
        return ()
    names = "|".join(re.escape(tool.name) for tool in tools)
    by_name = {tool.name: tool for tool in tools}
    calls: list[Call] = []
    for match in re.finditer(rf"<({names})>(.*?)(</\1>|$)", text, re.DOTALL):
        name, argument, closing = match.groups()
        if not closing:
            calls.append(MalformedCall(match.group(0), f"the call is not closed with </{name}>"))
        else:
            calls.append(ToolCall(name, {by_name[name].argument: argument.strip()}))
    return tuple(calls)


@dataclass(frozen=True)
class Convention:
    """A way of writing tool calls: how they are read from a turn, how each result is written back, and where a
    model's turn that calls ends (a multi-turn rollout stops decoding there and lets the environment answer)."""

    parse: Callable[[str, Sequence[Tool]], tuple[Call, ...]]
    result: str
    """The format of one result (`str.format` with `output`)."""
    call_ends: Callable[[Sequence[str]], tuple[str, ...]]
    """The texts that close a call, given the offered tools' names."""

    def error_results(self, observation: str) -> int:
        """How many results in `observation` say "error: ..." (as `call_tools` answers every failed call)."""
        return observation.count(self.result.partition("{output}")[0] + "error:")


PARSERS: dict[str, Convention] = {
    "hermes": Convention(parse_hermes, "<tool_response>\n{output}\n</tool_response>", lambda names: ("</tool_call>",)),
    "plain": Convention(parse_plain, "<result>{output}</result>", lambda names: tuple(f"</{name}>" for name in names)),
}


def convention(name: str) -> Convention:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; use one of {sorted(PARSERS)}")
    return PARSERS[name]


def parse_turn(text: str, tools: Sequence[Tool], parser: str = "hermes", index: int = 0) -> Turn:
    """The model's turn `index` of an episode, with the calls its text makes under `parser`'s convention."""
    return Turn(text, convention(parser).parse(text, tools), parser, index)


def call_tools(turn: Turn, tools: Sequence[Tool]) -> str:
    """The turn's calls answered in order, each result in the turn's convention, joined by newlines: a tool's output,
    or what is wrong (an unknown tool, a malformed call). "" where the turn makes no call."""
    by_name = {tool.name: tool for tool in tools}
    outputs = []
    for call in turn.tool_calls:
        if isinstance(call, MalformedCall):
            output = f"error: {call.error}"
        elif call.name not in by_name:
            output = f"error: no tool {call.name!r}; the tools are {', '.join(sorted(by_name)) or 'none'}"
        else:
            output = by_name[call.name](call)
        outputs.append(convention(turn.parser).result.format(output=output))
    return "\n".join(outputs)


def render_prompt(tokenizer, messages: Sequence[dict], tools: Sequence[dict]) -> str:
    """The prompt of chat `messages` offering `tools` (their schemas, `Tool.schema()`), as the model's own chat
    template writes it (a transformers tokenizer's `apply_chat_template(messages, tools=...)`), ready for the model's
    turn. A template that does not write tools is refused: the model would be offered nothing and never learn to
    call."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template to offer tools with; use parser plain and say the tools")

    def rendered(offered: list[dict] | None) -> str:
        return tokenizer.apply_chat_template(list(messages), tools=offered, add_generation_prompt=True, tokenize=False)

    prompt = rendered(list(tools) or None)
    if tools and prompt == rendered(None):
        raise ValueError(
            "the tokenizer's chat template does not write the tools it is given (no `tools` in it): use a model whose "
            "template takes tools (Qwen2.5, Qwen3, Hermes...), or parser plain with the tools said in the prompt"
        )
    return prompt


def tools_then_answer(turn: Turn, tools: Sequence[Tool], max_turns: int, answer: str) -> StepResult:
    """A question answered with tools (the built-in environments): a turn that calls tools gets their results, and
    reward 0 once it is the last turn allowed; a turn without a call is the answer, rewarded 1 where it matches
    `answer` as the math graders match, and ends the episode."""
    if turn.tool_calls:
        observation = call_tools(turn, tools)
        if turn.index + 1 >= max_turns:
            return StepResult(observation, reward=0.0, done=True)
        return StepResult(observation)
    return StepResult(reward=float(answers_match(turn.text, answer)), done=True)
