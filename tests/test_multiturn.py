"""Multi-turn rollouts and their training in the reference loop (`pipelines.lm.multiturn`, docs/environments.md): a
turn ends where a tool call closes, the environment answers in its own process and the observation is appended; the
trajectory's mask says what the model sampled; observation tokens get no gradient and count in no normaliser; the
same seed gives the same trajectories, whatever waits and batches; the reference loop trains an env config, and
`policy: auto` refuses one in one line (tests/test_multiturn_ray.py: the Ray policies that run one)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from running import train
from test_envs import HERMES_TEMPLATE
from test_run_ux import undocumented
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dovetail.config.common import PACKAGE_ROOT, ConfigError
from dovetail.config.load import parse_config
from dovetail.envs.contract import Latency
from dovetail.envs.host import EnvironmentHost
from dovetail.graph.node import SampleId
from dovetail.models.causal_lm import HFTokenizer, StopStrings
from dovetail.models.engine import RePrefillingEngine, Request, SamplingParams, TorchEngine, is_finished
from dovetail.models.lm import load_lm
from dovetail.models.lm_rl import policy_gradient
from dovetail.pipelines.lm import config as lm_config
from dovetail.pipelines.lm.multiturn import Conversation, Segment, run_episodes

torch.set_num_threads(1)

SORT_LM = PACKAGE_ROOT / "assets" / "sort-lm"
ANSWERS = {"mul 12*34:": "408", "mul 56*78:": "4368", "mul 91*23:": "2093"}
CALC_TOOLS = ({"type": "function", "function": {"name": "calc"}},)
"""What `EnvironmentHost.tools` answers for the arithmetic environment, as far as a rollout reads it: the name."""


def env_tree(tmp_path: Path) -> dict:
    """An env run of the built-in sort model on arithmetic rows it can spell, two groups of two a step."""
    rows = [{"question": f"mul {a}*{b}:", "answer": str(a * b)} for a, b in [(12, 34), (56, 78), (91, 23), (45, 6)]]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return {
        "kind": "lm",
        "task": "sort",
        "prompts": {"path": str(path), "prompt_field": "question", "eval_path": str(path)},
        "env": {"name": "arithmetic", "parser": "plain", "options": {"max_turns": 3}},
        "sampling": {"max_new_tokens": 32},
        "algo": {"prompts_per_step": 2, "group_size": 2, "micro_batches": 1},
        "eval": {"prompts": 2, "every": 100},
    }


def env_config(tmp_path: Path):
    return parse_config(env_tree(tmp_path))


# ------------------------------------------------------------------------------------------ a turn's end


def test_a_turn_ends_by_its_own_tokens_and_budget_not_by_the_turns_before_it():
    _, tokenizer, _ = load_lm(SORT_LM)
    stop = StopStrings(tokenizer, ["</calc>"])
    tokens = tokenizer.encode("<calc>1</calc>x")
    request = Request((0, 0, 0), [tokenizer.bos_id], tokens, [0.0] * len(tokens))
    params = SamplingParams(max_new_tokens=64, stop_ids=tokenizer.stop_ids)
    assert is_finished(request, params, stop)  # one turn: its "</calc>" is in the window the stop reads
    later = Request((0, 0, 0), [tokenizer.bos_id], tokens, [0.0] * len(tokens), turn_start=len(tokens) - 1)
    assert not is_finished(later, params, stop)  # a turn after it reads its own "x"
    assert is_finished(later, SamplingParams(max_new_tokens=64, max_turn_tokens=1), None)
    assert not is_finished(later, SamplingParams(max_new_tokens=64, max_turn_tokens=2), None)
    assert is_finished(later, SamplingParams(max_new_tokens=len(tokens)), None)  # the trajectory's budget, all turns


# ------------------------------------------------------------------------------------------ a scripted policy


class ScriptedModel(RePrefillingEngine):
    """A policy that is a script, decoded through the engine contract and its turn rules (`is_finished`): on a
    "mul X:" question it calls the calculator on X (and would go on writing, but the call's end stops the turn),
    then answers with the last result; on "loop X:" it calls for ever. Each generate call's trajectories are kept."""

    def __init__(self, tokenizer, params: SamplingParams, stop):
        self.tokenizer, self.params, self.stop = tokenizer, params, stop
        self.max_len, self.paused, self.batches = 128, {}, []

    def load_weights(self, state_dict):
        pass

    def held_bytes(self) -> int:
        return 0

    def _decode_until(self, requests, limit):
        self.batches.append({r.key for r in requests})
        for request in requests:
            while not request.finished and len(request.tokens) < limit:
                request.tokens.append(self._next(request))
                request.log_probs.append(-0.25)
                request.finished = is_finished(request, self.params, self.stop)

    def _next(self, request) -> int:
        question = self.tokenizer.decode(request.prompt)
        said = self.tokenizer.decode(request.tokens)
        expression = question.split(" ", 1)[1].rstrip(":")
        if question.startswith("mul") and "<result>" in said:
            script = f"<answer>{said.rpartition('<result>')[2].partition('</result>')[0]}</answer>"
        else:
            script = f"<calc>{expression}</calc> and on"
        turn = self.tokenizer.decode(request.tokens[request.turn_start :])
        return self.tokenizer.encode(script[len(turn)])[0] if len(turn) < len(script) else self.tokenizer.eos_id


@pytest.fixture(scope="module")
def arithmetic_host():
    host = EnvironmentHost("arithmetic", {"max_turns": 5}, "plain", Latency(), seed=0, timeout_s=30)
    yield host
    host.stop()


def scripted_rollout(tmp_path, host, questions, **clocks):
    config = env_config(tmp_path)
    _, tokenizer, _ = load_lm(SORT_LM)
    params = SamplingParams(max_new_tokens=100, stop_ids=tokenizer.stop_ids)
    engine = ScriptedModel(tokenizer, params, StopStrings(tokenizer, ["</calc>"]))
    conversation = Conversation(config, tokenizer, CALC_TOOLS, context=128)
    samples = [SampleId(0, p, 0) for p in range(len(questions))]
    rows = [{"question": question, "answer": ANSWERS.get(question, "none")} for question in questions]
    trajectories, slept = run_episodes(engine, host, conversation, samples, rows, **clocks)
    return trajectories, slept, engine, tokenizer


def test_a_scripted_episode_gives_the_turns_observations_mask_and_reward_expected(tmp_path, arithmetic_host):
    trajectories, slept, _, tokenizer = scripted_rollout(
        tmp_path, arithmetic_host, ["mul 12*34:", "mul 7/0:", "loop 1+1:"]
    )
    solved, refused, looping = trajectories
    turn, observation, answer = "<calc>12*34</calc>", "<result>408</result>", "<answer>408</answer>"
    assert solved.prompt == tuple(tokenizer.prompt_ids("mul 12*34:"))
    assert solved.segments == (
        Segment(tuple(tokenizer.encode(turn)), (-0.25,) * len(turn)),
        Segment(tuple(tokenizer.encode(observation))),
        Segment((*tokenizer.encode(answer), tokenizer.eos_id), (-0.25,) * (len(answer) + 1)),
    )
    assert solved.tokens == [*tokenizer.encode(turn + observation + answer), tokenizer.eos_id]
    assert solved.generated == [True] * len(turn) + [False] * len(observation) + [True] * (len(answer) + 1)
    assert solved.log_probs == [-0.25] * len(turn) + [0.0] * len(observation) + [-0.25] * (len(answer) + 1)
    assert (solved.reward, solved.turns, solved.tool_calls, solved.tool_errors, solved.done) == (1.0, 2, 1, 0, True)
    assert tokenizer.decode(refused.segments[1].tokens) == "<result>error: 7 / 0 divides by zero</result>"
    assert (refused.reward, refused.turns, refused.tool_calls, refused.tool_errors, refused.done) == (
        0.0,
        2,
        1,
        1,
        True,
    )
    # env.max_turns=3 cuts the trajectory that calls for ever (its environment would go on to 5): not done, reward 0
    assert (looping.turns, looping.tool_calls, looping.done, looping.reward) == (3, 3, False, 0.0)
    assert [s.sampled for s in looping.segments] == [True, False, True, False, True]
    assert slept == 0.0


def test_a_trajectory_waiting_on_its_environment_leaves_the_others_decoding_and_changes_nothing(tmp_path):
    questions = ["mul 12*34:", "mul 56*78:", "mul 91*23:", "loop 2+2:"]
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    latency = Latency(kind="lognormal", median_s=1.0, sigma=1.0)
    host = EnvironmentHost(
        "arithmetic", {"tool_latency": {"kind": "constant", "seconds": 0.5}}, "plain", latency, 7, 30
    )
    instant = EnvironmentHost("arithmetic", {}, "plain", Latency(), 0, 30)
    try:
        waited, slept, engine, _ = scripted_rollout(tmp_path, host, questions, clock=lambda: now[0], sleep=sleep)
        at_once, slept_at_once, _, _ = scripted_rollout(tmp_path, instant, questions)
    finally:
        host.stop()
        instant.stop()
    assert waited == at_once and slept_at_once == 0.0  # a trajectory's tokens are its own, whenever it decodes
    everyone = {(0, p, 0) for p in range(len(questions))}
    assert engine.batches[0] == everyone
    assert any(batch < everyone for batch in engine.batches)  # some decoded while others still waited
    # decoding takes no time on this clock: the loop slept as long as the trajectory that waited longest, each of its
    # steps but the last waiting its lognormal draw and 0.5 s for its call; one after another they would wait more
    waits = [sum(latency.draw(7, *t.sample, turn, "environment") + 0.5 for turn in range(t.turns - 1)) for t in waited]
    assert slept == pytest.approx(max(waits)) and max(waits) < sum(waits)


# ------------------------------------------------------------------------------------------ observation tokens


def test_observation_tokens_get_no_gradient_and_count_in_no_normaliser(tmp_path):
    """Through `policy_gradient` as a train part runs it, with the KL and the entropy bonus on: the gradient reaching
    the logits that predict an observation token is exactly 0, and the normaliser and the token count are the model
    tokens'; the gradient is the independent loss's, written from a plain forward of the whole trajectory."""
    model, tokenizer, _ = load_lm(SORT_LM)
    model.train()
    prompt = tokenizer.prompt_ids("mul 12*34:")
    parts = [("<calc>12*34</calc>", True), ("<result>408</result>", False), ("<answer>408</answer>", True)]
    second = [("<calc>1*1</calc>", True), ("<result>1</result>", False), ("<answer>7</answer>", True)]
    samples = [SampleId(0, 0, 0), SampleId(0, 0, 1)]
    tokens, generated = {}, {}
    for sample, trajectory in zip(samples, (parts, second)):
        tokens[sample] = [t for text, _ in trajectory for t in tokenizer.encode(text)]
        generated[sample] = [sampled for text, sampled in trajectory for _ in text]
    requests = {s: Request(s, prompt, tokens[s], [0.0] * len(tokens[s]), True) for s in samples}
    rewards = {samples[0]: 1.0, samples[1]: 0.0}
    ref = {s: torch.full((len(tokens[s]),), -3.0) for s in samples}  # another model's: a KL with a gradient
    algo = env_config(tmp_path).algo.model_copy(update={"beta": 0.5, "entropy_coef": 0.1})

    logits_seen = []

    def keep(module, inputs, output):
        output.retain_grad()
        logits_seen.append(output)

    hook = model.lm_head.register_forward_hook(keep)
    try:
        gradient, stats, normaliser = policy_gradient(
            model,
            requests,
            rewards,
            {},
            ref,
            algo=algo,
            temperature=1.0,
            max_new_tokens=64,
            stale=False,
            generated=generated,
        )
    finally:
        hook.remove()
    model_tokens = sum(map(sum, generated.values()))
    assert normaliser == model_tokens and stats[0]["tokens"] == model_tokens
    # the prompt pass's last logits predict token 0, the response pass's position j - 1 predicts token j
    first, rest = logits_seen
    predicting = torch.cat([first.grad[:, -1:].expand(2, 1, -1), rest.grad], dim=1).abs().sum(-1)
    for row, sample in enumerate(samples):
        flags = torch.tensor(generated[sample])
        assert (predicting[row, : len(flags)][~flags] == 0).all()
        assert (predicting[row, : len(flags)][flags] > 0).all()

    # the same gradient from the loss written out: mean over model tokens of -A·ratio + β·k3 - c·entropy
    model.zero_grad()
    width = max(map(len, tokens.values()))
    ids = torch.tensor([prompt + tokens[s] + [0] * (width - len(tokens[s])) for s in samples])
    distributions = model(input_ids=ids).logits[:, len(prompt) - 1 : -1].log_softmax(-1)
    loss = torch.zeros(())
    advantage = 0.5 / (0.5 + 1e-4)  # rewards 1 and 0: (r - mean) / (population std + 1e-4)
    advantages = {samples[0]: advantage, samples[1]: -advantage}
    for row, sample in enumerate(samples):
        for j, token in enumerate(tokens[sample]):
            if not generated[sample][j]:
                continue
            log_prob = distributions[row, j, token]
            d = ref[sample][j] - log_prob
            entropy = -(distributions[row, j].exp() * distributions[row, j]).sum()
            surrogate = -advantages[sample] * torch.exp(log_prob - log_prob.detach())
            loss = loss + surrogate + algo.beta * (torch.exp(d) - d - 1) - algo.entropy_coef * entropy
    loss.backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).double()
    assert (gradient - expected).norm() < 1e-5 * expected.norm()  # fp32 passes of two shapes


# ------------------------------------------------------------------------------------------ exactness on our engine


CHATTY = """
from dovetail.envs import Environment, StepResult


class Chatty(Environment):
    \"\"\"Answers each turn "more:" with a reward of 0.5, and ends the episode at the third, rewarding its length.\"\"\"

    def reset(self, row):
        return row["question"]

    def step(self, turn):
        if turn.index < 2:
            return StepResult("more:", reward=0.5)
        return StepResult(reward=float(len(turn.text)), done=True)
"""


@pytest.fixture(scope="module")
def chatty_host(tmp_path_factory):
    """An environment that keeps every trajectory three turns, in a module the episodes' process imports."""
    directory = tmp_path_factory.mktemp("envs")
    (directory / "chatty_envs.py").write_text(CHATTY)
    sys.path.insert(0, str(directory))
    host = EnvironmentHost("chatty_envs:Chatty", {}, "plain", Latency(), seed=0, timeout_s=30)
    yield host
    host.stop()
    sys.path.remove(str(directory))


def rollout_on_the_engine(config, host, seed: int, one_at_a_time: bool = False):
    """Four trajectories of three turns of at most three tokens, two groups, sampled by the sort model."""
    model, tokenizer, _ = load_lm(SORT_LM)
    params = SamplingParams(max_new_tokens=32, stop_ids=tokenizer.stop_ids, seed=seed, max_turn_tokens=3)
    engine = TorchEngine.from_model(model, params, max_len=128)
    conversation = Conversation(config, tokenizer, (), context=128)
    samples = [SampleId(3, p, i) for p in range(2) for i in range(2)]
    rows = [{"question": question} for question in ("sort dcba:", "sort dcba:", "sort zyx:", "sort zyx:")]
    if one_at_a_time:
        return [run_episodes(engine, host, conversation, [s], [r])[0][0] for s, r in zip(samples, rows)]
    return run_episodes(engine, host, conversation, samples, rows)[0]


def test_the_same_seed_gives_the_same_trajectories_on_our_engine_whatever_the_batch(tmp_path, chatty_host):
    config = env_config(tmp_path)
    _, tokenizer, _ = load_lm(SORT_LM)
    trajectories = rollout_on_the_engine(config, chatty_host, seed=1)
    for t in trajectories:
        assert [s.sampled for s in t.segments] == [True, False, True, False, True] and t.done and t.turns == 3
        assert [tokenizer.decode(s.tokens) for s in t.segments[1::2]] == ["more:", "more:"]
        assert all(1 <= len(s.tokens) <= 3 for s in t.segments[::2])  # env.max_turn_tokens
        assert t.reward == 0.5 + 0.5 + len(tokenizer.decode(t.segments[-1].tokens))  # the turns' rewards, summed
    assert rollout_on_the_engine(config, chatty_host, seed=1) == trajectories
    alone = rollout_on_the_engine(config, chatty_host, seed=1, one_at_a_time=True)
    assert [t.tokens for t in alone] == [t.tokens for t in trajectories]  # log-probs: within fp32 rounding
    assert [t.tokens for t in rollout_on_the_engine(config, chatty_host, seed=2)] != [t.tokens for t in trajectories]


def test_a_waiting_trajectory_keeps_its_cache_and_its_next_turn_prefills_only_the_observation(tmp_path, chatty_host):
    """`multi_turn`: a finished turn keeps its slot's cache, and the next turn prefills the turn's last token and the
    observation onto it, where a re-prefilling engine computes the whole trajectory again: the prompts once and each
    observation are all it prefills. The trajectories are the re-prefilling engine's, token for token (log-probs
    within fp32 rounding); with slots for fewer trajectories than run, kept caches give way and come back by a
    re-prefill, with the same tokens. A trajectory done releases its slot."""
    config = env_config(tmp_path)
    model, tokenizer, _ = load_lm(SORT_LM)
    conversation = Conversation(config, tokenizer, (), context=128)
    samples = [SampleId(3, p, i) for p in range(2) for i in range(2)]
    rows = [{"question": question} for question in ("sort dcba:", "sort dcba:", "sort zyx:", "sort zyx:")]

    def rollout(multi_turn: bool, slots: int | None = None):
        params = SamplingParams(
            max_new_tokens=32, stop_ids=tokenizer.stop_ids, seed=1, max_turn_tokens=3, multi_turn=multi_turn
        )
        engine = TorchEngine.from_model(model, params, max_len=128, max_batch=slots or 32, num_slots=slots)
        trajectories = run_episodes(engine, chatty_host, conversation, samples, rows)[0]
        assert not engine.kept and set(engine.slot_owner) == {None}  # a done trajectory's cache is released
        return trajectories, engine.prefill_tokens

    kept, kept_prefilled = rollout(multi_turn=True)
    again, again_prefilled = rollout(multi_turn=False)
    evicted, evicted_prefilled = rollout(multi_turn=True, slots=2)
    prompts = [conversation.prompt(row["question"]) for row in rows]
    observations = [segment.tokens for t in kept for segment in t.segments if not segment.sampled]
    assert len(observations) == 8  # two a trajectory: three turns each
    assert kept_prefilled == sum(len(p) - 1 for p in prompts) + sum(map(len, observations))
    assert again_prefilled > kept_prefilled and evicted_prefilled > kept_prefilled
    for trajectories in (again, evicted):
        assert [t.tokens for t in trajectories] == [t.tokens for t in kept]
        for ours, theirs in zip(trajectories, kept):
            torch.testing.assert_close(torch.tensor(ours.log_probs), torch.tensor(theirs.log_probs), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------ the reference loop


def test_the_reference_loop_trains_an_env_config_and_reports_its_episodes(tmp_path):
    config = env_config(tmp_path)
    train(config, tmp_path / "run", steps=2)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert {"env/turns", "env/tool_calls", "env/tool_errors", "env/unfinished", "reward/env", "decode_s"} <= set(
            line
        )
        assert line["env/turns"] >= 1 and line["reward/total"] == line["reward/env"]
    assert {"eval_reward", "eval/reward/env"} <= set(lines[-1])  # the held-out trajectories' environment reward
    assert undocumented({key for line in lines for key in line}) == []


def test_auto_takes_an_environment_and_a_policy_that_does_not_is_refused_in_one_line(tmp_path, monkeypatch):
    """`auto` chooses for an env config (it simulates each policy on the config's turns: tests/test_multiturn_ray.py
    runs one); a policy that does not roll out environments is refused in one line naming those that do."""
    tree = env_tree(tmp_path)
    assert parse_config({**tree, "policy": "auto"}).policy == "auto"
    multiplexed = {"kind": "multiplex", "policy": "auto", "pipelines": [{**tree, "name": "calc"}, {"kind": "flow"}]}
    assert parse_config(multiplexed).policy == "auto"
    monkeypatch.setattr(lm_config, "ENV_POLICIES", tuple(p for p in lm_config.ENV_POLICIES if p != "areal"))
    with pytest.raises(ConfigError) as refused:
        parse_config({**tree, "policy": "areal"})
    assert str(refused.value) == (
        "invalid config: env: policy areal does not choose for environments yet; set policy: verl-sync (or another of "
        "reference, auto, verl-sync, streamrl, jigsaw, jigsaw-greedy)"
    )


# ------------------------------------------------------------------------------------------ a chat template


def test_an_observation_after_a_turn_is_what_the_chat_template_writes_there(tmp_path):
    vocabulary = {"<unk>": 0, "<|im_end|>": 1, **{c: i + 2 for i, c in enumerate("abc")}}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = HERMES_TEMPLATE
    conversation = Conversation(env_config(tmp_path), HFTokenizer(fast, (1,), tmp_path), CALC_TOOLS, context=4096)
    question = [{"role": "user", "content": "What is 12*34?"}]
    turn = '<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>'
    observation = "<tool_response>\n408\n</tool_response>"
    whole = fast.apply_chat_template(
        [*question, {"role": "assistant", "content": turn}, {"role": "tool", "content": "408"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    start = fast.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    assert start + turn + conversation.observation_text(observation, last=2) == whole  # stopped at the call's end
    assert start + turn + "<|im_end|>" + conversation.observation_text(observation, last=1) == whole  # at its eos
