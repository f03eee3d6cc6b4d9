"""Several pipelines multiplexed on one pool of Ray devices (JigsawRL): a language-model and a flow pipeline share
two devices under `jigsaw` / `jigsaw-greedy`; each ends at the parameters it reaches alone under `reference`, in its
own run sub-directory, with its own ledger; the migrated tail and streamed micro-batches change nothing of that."""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import ray
from running import train
from two_pipelines import FLOW, LM, STEPS, final_weights, max_difference, same_parameters

from dovetail.config.common import ConfigError, multiplexing_policies
from dovetail.config.load import parse_config
from dovetail.graph.node import Role
from dovetail.pipelines.lm.messages import LMTrain
from dovetail.runtime.executor import RayExecutor
from dovetail.runtime.launch import AUTO_TIE, dry_run, start_devices_early
from dovetail.runtime.replay import replay_run
from dovetail.sched.jigsaw import Jigsaw, rollout_shares
from dovetail.sched.policy import SwitchRole

pytestmark = pytest.mark.slow


def multiplexed(policy: str, *pipelines: dict) -> dict:
    return {"kind": "multiplex", "policy": policy, "cluster": {"devices": 2}, "pipelines": list(pipelines)}


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """Each pipeline trained alone by the reference loop."""
    runs = {}
    for name, tree in (("sort", LM), ("digits", FLOW)):
        runs[name] = tmp_path_factory.mktemp(f"alone-{name}")
        train(parse_config(tree | {"policy": "reference"}), runs[name], steps=STEPS)
    return runs


def shared_pool(cls, context):
    """jigsaw's search made to keep every pipeline on the whole pool, at once (on these two small pipelines it runs
    them back to back, tests/test_cluster.py): its look-ahead then orders the two pipelines' trainer work."""
    return rollout_shares(context.specs, dict(context.shapes), context.costs, context.steps)


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("policy", ["jigsaw-greedy", "jigsaw"])
def test_an_lm_and_a_flow_pipeline_multiplexed_end_where_each_ends_alone(policy, alone, tmp_path, monkeypatch):
    monkeypatch.setattr(Jigsaw, "plan_shapes", classmethod(shared_pool))
    summary = train(parse_config(multiplexed(policy, LM, FLOW)), tmp_path, steps=STEPS)
    assert set(summary["pipelines"]) == {"sort", "digits"}
    for name in ("sort", "digits"):
        own = tmp_path / name
        assert json.loads((own / "ledger.json").read_text())["problems"] == []
        assert len((own / "metrics.jsonl").read_text().splitlines()) == STEPS
        assert same_parameters(name, final_weights(alone[name]), final_weights(own))
    spans = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    devices_of = {name: {e["tid"] for e in spans if e["name"].startswith(f"{name}:")} for name in ("sort", "digits")}
    assert devices_of["sort"] and devices_of["digits"]
    assert devices_of["sort"] & devices_of["digits"], "the pipelines share the pool's devices"
    assert (tmp_path / "gantt.png").exists() and (tmp_path / "curves.png").exists()  # each with every pipeline
    assert not any((tmp_path / name / "curves.png").exists() for name in ("sort", "digits"))
    assert json.loads((tmp_path / "ledger.json").read_text()).keys() == {"sort", "digits"}
    if policy == "jigsaw-greedy":  # the simulator, given the costs this run measured, predicts it (see BENCHMARKS.md
        # for jigsaw's replay: its look-ahead re-decides on durations that already hold the interference)
        replay = replay_run(tmp_path)
        assert abs(replay["relative_error"]) < 0.3, replay


@pytest.mark.usefixtures("local_ray")
def test_back_to_back_under_jigsaw_runs_one_pipeline_after_the_other_each_ending_where_it_ends_alone(alone, tmp_path):
    """The arrangement jigsaw weighs against multiplexing, run on the Ray runtime (the run's `arrangement` asks for
    it): sort runs every step on both devices, then digits does; each ends at the reference's parameters, and digits'
    first step is timed from its own start, not from the run's."""
    tree = multiplexed("jigsaw", LM, FLOW) | {"arrangement": "back_to_back"}
    summary = train(parse_config(tree), tmp_path, steps=STEPS)
    events = [
        e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if "step" in e.get("args", {})
    ]
    spans = {name: [e for e in events if e["name"].startswith(f"{name}:")] for name in ("sort", "digits")}
    # microseconds: sort's last node may end at the instant digits' first starts
    assert max(e["ts"] + e["dur"] for e in spans["sort"]) <= min(e["ts"] for e in spans["digits"]) + 1e-3
    assert all({e["tid"] for e in spans[name]} == {0, 1} for name in spans)
    for name in ("sort", "digits"):
        assert json.loads((tmp_path / name / "ledger.json").read_text())["problems"] == []
        assert same_parameters(name, final_weights(alone[name]), final_weights(tmp_path / name))
    # digits' first step, timed from the run's start, would span sort's steps too: from_run; from its own, about
    # `from_run` less sort's time (sort's last step ends where digits' first begins)
    first_digits_commit = next(e for e in spans["digits"] if e["name"] == "digits:commit" and e["args"]["step"] == 0)
    sort_s = (max(e["ts"] + e["dur"] for e in spans["sort"]) - min(e["ts"] for e in spans["sort"])) / 1e6
    from_run = (first_digits_commit["ts"] + first_digits_commit["dur"] - min(e["ts"] for e in spans["sort"])) / 1e6
    first_digits_step = json.loads((tmp_path / "digits" / "metrics.jsonl").read_text().splitlines()[0])["step_s"]
    assert first_digits_step < from_run - sort_s / 2, (first_digits_step, from_run, sort_s)
    assert summary["pipelines"]["digits"]["steps"] == STEPS


@pytest.mark.usefixtures("local_ray")
def test_devices_started_before_the_run_are_the_ones_each_pipeline_takes_up(tmp_path):
    """The command line starts Ray and every pipeline's device workers first, each importing its pipeline's engines
    while the command imports its own (`launch.start_devices_early`); the run then takes up those very workers, each
    pipeline its own (the slots of `start_workers`), and starts none."""
    config = parse_config(multiplexed("jigsaw", LM, FLOW) | {"arrangement": "back_to_back"})

    def pids(workers) -> list[int]:
        return ray.get([worker.ping.remote() for worker in workers])

    early = {name: pids(workers) for name, workers in start_devices_early(config).items()}
    taken: dict[str, list[int]] = {}
    train(
        config,
        tmp_path,
        steps=1,
        after_start=lambda started: taken.update({name: pids(s.workers) for name, s in started.items()}),
    )
    assert taken == early and len({pid for p in early.values() for pid in p}) == 4


@pytest.mark.usefixtures("local_ray")
def test_two_language_model_pipelines_multiplexed_end_where_each_ends_alone(alone, tmp_path):
    """Two LM pipelines of the same task and model (their prompts differ by seed) keep apart: weights, versions,
    optimizer, ledger; each ends where it ends alone (the first is `alone`'s sort)."""
    second = LM | {"name": "sort-b", "seed": 7, "train": {"lr": 5e-4}}
    train(parse_config(multiplexed("jigsaw", LM, second)), tmp_path / "both", steps=STEPS)
    train(parse_config(second | {"policy": "reference"}), tmp_path / "sort-b", steps=STEPS)
    for name, own in (("sort", alone["sort"]), ("sort-b", tmp_path / "sort-b")):
        assert json.loads((tmp_path / "both" / name / "ledger.json").read_text())["problems"] == []
        assert same_parameters("sort", final_weights(own), final_weights(tmp_path / "both" / name))
    assert max_difference(final_weights(alone["sort"]), final_weights(tmp_path / "sort-b")) > 1e-4


@pytest.mark.usefixtures("local_ray")
def test_the_long_tail_migrates_and_streamed_micro_batches_train_what_the_batch_would(alone, tmp_path):
    """Length bands and a migration edge: the responses still decoding at the edge move to one engine (re-prefilled
    token for token), whole groups train in finishing order while the tail decodes; the weights are the batch's."""
    banded = LM | {"runtime": LM["runtime"] | {"length_bands": [4, 8, 12]}}
    train(parse_config(multiplexed("jigsaw-greedy", banded, FLOW)), tmp_path, steps=STEPS)
    ledger = json.loads((tmp_path / "sort" / "ledger.json").read_text())
    assert ledger["problems"] == [] and ledger["migrated"], ledger["migrated"]
    assert same_parameters("sort", final_weights(alone["sort"]), final_weights(tmp_path / "sort"))


@pytest.mark.usefixtures("local_ray")
def test_a_killed_worker_in_a_multiplexed_run_loses_no_sample_of_any_pipeline(alone, tmp_path):
    """The LM pipeline's worker on a device dies holding gradients of its open step: Ray restarts it, its
    gradients are rebuilt; the flow pipeline's worker on that device is another process and never notices."""
    killed = []

    def kill(executor, part):
        if not killed and isinstance(part.work, LMTrain) and part.work.samples and part.work.samples[0].step == 1:
            killed.append((part.device, part.node))
            ray.kill(executor.worker_of(part), no_restart=False)

    summary = train(parse_config(multiplexed("jigsaw", LM, FLOW)), tmp_path, steps=STEPS, after_part=kill)
    assert killed and summary["restarts"] >= 1
    for name in ("sort", "digits"):
        assert json.loads((tmp_path / name / "ledger.json").read_text())["problems"] == []
        assert same_parameters(name, final_weights(alone[name]), final_weights(tmp_path / name))
    reruns = json.loads((tmp_path / "sort" / "ledger.json").read_text())["reruns"]
    assert dict(zip(("device", "node"), killed[0])) in reruns


@pytest.mark.usefixtures("local_ray")
def test_a_run_killed_at_uneven_steps_resumes_every_pipeline_to_the_undisturbed_parameters(alone, tmp_path, capsys):
    """`dovetail train` SIGKILLed the moment one pipeline has saved (checkpointing every step, before its line is
    printed) a step the other has not: no handler of the run's runs, a checkpoint or a metrics line may be half
    written. `--resume` takes every pipeline back to the newest step all of them saved and ends each where it ends
    alone."""
    every_step = {"checkpoint": {"every": 1}}
    tree = multiplexed("jigsaw", LM | every_step, FLOW | every_step)
    (tmp_path / "config.yaml").write_text(json.dumps(tree))  # JSON is YAML
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dovetail.cli", "train", str(tmp_path / "config.yaml"), "--steps", str(STEPS)]
    process = subprocess.Popen([*command, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ahead = None
    for line in process.stdout:
        if match := re.search(r"(\w+) step 2/", line):
            process.kill()
            ahead = match[1]
            break
    process.wait(timeout=60)
    assert ahead is not None, process.stderr.read()
    saved = {name: sorted(p.name for p in (out / name).glob("checkpoints/step_*")) for name in ("sort", "digits")}
    assert saved[ahead] == ["step_000001", "step_000002"] and len({tuple(v) for v in saved.values()}) == 2, saved
    capsys.readouterr()
    train(parse_config(tree), out, steps=STEPS, resume=out)
    assert "the pipelines stopped unevenly" in capsys.readouterr().err
    for name in ("sort", "digits"):
        assert json.loads((out / name / "ledger.json").read_text())["problems"] == []
        assert same_parameters(name, final_weights(alone[name]), final_weights(out / name))
        assert [json.loads(line)["step"] for line in (out / name / "metrics.jsonl").read_text().splitlines()] == [
            1,
            2,
            3,
        ]


def test_a_pipeline_whose_reward_fails_stops_alone_and_the_other_goes_on(local_ray, alone, tmp_path):
    flag = local_ray
    broken = LM | {"reward": {"faulty_reward:nan_text_when_flagged": 1.0}}

    def break_after_first_commit(executor, part):
        if part.node == "sort/0/commit":
            flag.touch()

    try:
        config = parse_config(multiplexed("jigsaw", broken, FLOW))
        summary = train(config, tmp_path, steps=STEPS, after_part=break_after_first_commit)
    finally:
        flag.unlink(missing_ok=True)
    assert set(summary["stopped"]) == {"sort"}
    assert re.search(r"nan_text_when_flagged.*pipeline sort stopped.*step_000001.*--resume", summary["stopped"]["sort"])
    assert sorted(p.name for p in (tmp_path / "sort" / "checkpoints").iterdir()) == ["step_000001"]
    assert summary["pipelines"]["sort"]["steps"] == 1 and summary["pipelines"]["digits"]["steps"] == STEPS
    assert json.loads((tmp_path / "digits" / "ledger.json").read_text())["problems"] == []
    assert max_difference(final_weights(alone["digits"]), final_weights(tmp_path / "digits")) <= 1e-5


def test_policy_auto_plans_every_multiplexing_policy_and_runs_the_fastest_predicted():
    """`policy=auto` on a multiplexed run weighs the policies that multiplex (not one pipeline kind's), on the
    catalogue's costs in a GPU dry run (analytic: no profile), and says which it takes and why."""
    tree = multiplexed("auto", LM, FLOW) | {"cluster": {"device": "H100", "devices": 8}}
    plan = dry_run(parse_config(tree), STEPS)
    predicted = plan["auto"]["predicted"]
    assert set(predicted) == set(multiplexing_policies()) and plan["policy"] in predicted
    assert predicted[plan["policy"]] >= (1 - AUTO_TIE) * max(predicted.values())
    assert plan["auto"]["line"].startswith(f"policy auto: {plan['policy']}, the fastest predicted")


def test_a_run_s_arrangement_keeps_jigsaw_to_it():
    """`arrangement` (a user who measured the split pool faster than jigsaw predicts it, say) keeps jigsaw's search to
    one arrangement: every pipeline on the whole pool at once, each on a sub-pool of its own, or one after the other on
    the whole pool. Planned on the catalogue's costs (a GPU dry run: nothing profiled)."""
    cluster = {"cluster": {"device": "H100", "devices": 8}}
    layouts = {}
    for arrangement in ("shared", "split", "back_to_back"):
        tree = multiplexed("jigsaw", LM, FLOW) | cluster | {"arrangement": arrangement}
        shapes = dry_run(parse_config(tree), STEPS)["shapes"]
        layouts[arrangement] = {  # a shape on the whole pool at once has no first device or turn: 0 and 0
            name: (set(range(first, first + shape["trainer_devices"])), shape.get("turn", 0))
            for name, shape in shapes.items()
            for first in [shape.get("first_device", 0)]
        }
    whole = set(range(8))
    assert layouts["shared"] == {"sort": (whole, 0), "digits": (whole, 0)}
    assert layouts["back_to_back"] == {"sort": (whole, 0), "digits": (whole, 1)}
    (sort, sort_turn), (digits, digits_turn) = layouts["split"]["sort"], layouts["split"]["digits"]
    assert sort and digits and not sort & digits and sort | digits == whole and sort_turn == digits_turn == 0


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (multiplexed("jigsaw", LM | {"policy": "verl-sync"}), "pipelines.0.policy: a multiplexed pipeline takes"),
        (multiplexed("jigsaw", LM, LM), "names must be unique"),
        (multiplexed("jigsaw", LM | {"name": "a/b"}), "pipelines.0.name"),
        (multiplexed("verl-sync", LM), "policy"),
        (multiplexed("jigsaw", LM | {"cluster": {"devices": 3}}), "pipelines.0.cluster"),
        (multiplexed("jigsaw", LM | {"priority": 0}), "pipelines.0.priority"),
        ({"kind": "multiplex", "pipelines": "sort"}, "pipelines: a list of pipeline configs"),
        (multiplexed("jigsaw", LM, FLOW) | {"arrangement": "diagonal"}, "arrangement"),
        (multiplexed("jigsaw-greedy", LM, FLOW) | {"arrangement": "split"}, "only policy jigsaw arranges"),
        (multiplexed("jigsaw", LM) | {"arrangement": "split"}, "one pipeline has no pool to split"),
    ],
)
def test_bad_multiplex_configs_name_the_field(tree, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(tree)


@ray.remote(num_cpus=0)
class SwitchingWorker:
    """A device worker's role switch, recorded; it takes the round trip it is given."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.roles: list[str] = []

    def switch_role(self, role: str) -> float:
        self.roles.append(role)
        return self.seconds

    def switched(self) -> list[str]:
        return self.roles


@pytest.mark.usefixtures("local_ray")
def test_a_role_switch_reaches_the_device_worker_of_every_pipeline_and_lasts_the_longest():
    """A device holds a rollout engine per pipeline, each of which must sleep while the device trains: the switch
    is done when every pipeline's worker on the device has switched, the slowest one's round trip."""
    workers = {
        "sort": [SwitchingWorker.remote(0.02), SwitchingWorker.remote(0.0)],
        "digits": [SwitchingWorker.remote(0.05), SwitchingWorker.remote(0.0)],
    }
    pipelines = {name: SimpleNamespace(workers=ws) for name, ws in workers.items()}
    executor = RayExecutor(None, None, pipelines, lost=lambda: None, nodes=list)  # type: ignore[arg-type]
    finished = []
    executor.state = SimpleNamespace(finish_switch=lambda *switch: finished.append(switch))
    executor._switch(SwitchRole(0, Role.TRAINER, 0.0, 1.5), list(pipelines))
    for ref, switch in list(executor._pending.items()):
        assert not finished, "the device switched before every pipeline's worker did"
        executor._switched(switch, ray.get(ref))
    assert finished == [(0, Role.TRAINER, 1.5)]
    assert executor.switch_seconds == [0.05]
    assert [ray.get(ws[0].switched.remote()) for ws in workers.values()] == [["trainer"], ["trainer"]]
    assert [ray.get(ws[1].switched.remote()) for ws in workers.values()] == [[], []]
