"""Node / Graph checks and the flow builder, recomputed independently from the spec and the cost model."""

import inspect

import planner_scenarios
import pytest

from dovetail.cost.catalog import diffusion_model
from dovetail.cost.model import CostModel
from dovetail.graph.flow import FlowShape, build_flow, engines, split
from dovetail.graph.lm import LMShape
from dovetail.graph.node import Graph, Kind, Node, Role
from dovetail.graph.shape import Shape
from dovetail.graph.spec import FlowSpec, LMSpec, PipelineSpec
from dovetail.kinds import KINDS
from dovetail.sched.digen_search import ranking_model

SPEC = FlowSpec(
    name="flux",
    model="FLUX.1-12B",
    prompts=6,
    group=3,
    denoising_steps=8,
    trained_timesteps=5,
    height=256,
    width=256,
    mini_batches=2,
)
COST = CostModel("H100")


def node(node_id, *deps):
    return Node(node_id, "p", 0, Kind.TRAIN, Role.ANY, deps)


def test_graph_orders_and_reports_ready_nodes():
    graph = Graph([node("c", "a", "b"), node("a"), node("b", "a")])
    assert graph.order == ["a", "b", "c"]
    assert [n.id for n in graph.ready(set())] == ["a"]
    assert [n.id for n in graph.ready({"a"})] == ["b"]
    assert [n.id for n in graph.ready({"a", "b"})] == ["c"]
    assert graph.ready({"a"}, started={"b"}) == []


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ([node("a"), node("a")], "duplicate node id 'a'"),
        ([node("a", "ghost")], "depends on unknown node 'ghost'"),
        ([node("a", "b"), node("b", "a")], "dependency cycle"),
    ],
)
def test_graph_rejects_bad_structure(nodes, message):
    with pytest.raises(ValueError, match=message):
        Graph(nodes)


def test_node_rejects_negative_cost_and_empty_chunk():
    with pytest.raises(ValueError, match="cost_s"):
        Node("a", "p", 0, Kind.TRAIN, Role.ANY, cost_s=-1)
    with pytest.raises(ValueError, match="fixed_s"):
        Node("a", "p", 0, Kind.TRAIN, Role.ANY, fixed_s=-1)
    with pytest.raises(ValueError, match="chunk"):
        Node("a", "p", 0, Kind.TRAIN, Role.ANY, timesteps=(3, 3))


def test_a_node_spread_over_devices_pays_its_fixed_cost_on_each():
    spread = Node("a", "p", 0, Kind.TRAIN, Role.TRAINER, cost_s=2.0, fixed_s=0.25)
    assert [spread.seconds_on(d) for d in (1, 2, 4)] == [2.25, 1.25, 0.75]
    assert Node("c", "p", 0, Kind.COMMIT, Role.TRAINER, cost_s=0.5, fixed_s=0.25, collective=True).seconds_on(4) == 0.75
    assert Node("d", "p", 0, Kind.DECODE, Role.ROLLOUT, cost_s=2.0, fixed_s=0.25, max_width=1).seconds_on(4) == 2.25


def test_split_is_contiguous_and_balanced():
    parts = split(10, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert [i for p in parts for i in p] == list(range(10))


@pytest.mark.parametrize(("fragments", "chunk", "recompute"), [(2, 1, True), (6, 2, False), (4, 5, False)])
def test_flow_step_covers_every_sample_and_timestep_once(fragments, chunk, recompute):
    graph = Graph(build_flow(SPEC, 2, FlowShape(fragments, chunk, recompute, trainer_devices=3), COST))
    for step in (0, 1):
        nodes = graph.of("flux", step)
        generated = [s for n in nodes if n.kind == Kind.GENERATE for s in n.samples]
        expected = {(step, p, i) for p in range(SPEC.prompts) for i in range(SPEC.group)}
        assert sorted(generated) == sorted(expected)
        trained: dict = {}
        for n in nodes:
            if n.kind == Kind.TRAIN:
                for sample in n.samples:
                    trained.setdefault(sample, []).extend(range(*n.timesteps))
        assert all(sorted(t) == list(range(SPEC.trained_timesteps)) for t in trained.values())
        assert set(trained) == expected
        counts = {kind: sum(1 for n in nodes if n.kind == kind) for kind in Kind}
        assert counts[Kind.GENERATE] == counts[Kind.SCORE] == fragments
        assert counts[Kind.LOGPROB] == (fragments if recompute else 0)
        assert counts[Kind.TRAIN] == fragments * -(-SPEC.trained_timesteps // chunk)
        assert counts[Kind.COMMIT] == SPEC.mini_batches and counts[Kind.PUBLISH] == 1


def test_flow_nodes_cost_their_pairs_on_the_trainer_group():
    """Each train node is charged its fragment's (sample, timestep) pairs on the whole trainer group, each
    log-prob node its fragment's per-timestep forward loop; a staged trainer's nodes cover the mini-batch."""
    model = diffusion_model(SPEC.model)
    tokens = model.latent_tokens(SPEC.height, SPEC.width)
    for shape in (FlowShape(3 * 2, 2, True, 3), FlowShape(4, 1, True, 3, staged=True)):
        nodes = build_flow(SPEC, 1, shape, COST)
        for n in nodes:
            if n.kind == Kind.TRAIN:
                span = n.timesteps[1] - n.timesteps[0]
                assert n.cost_s == pytest.approx(
                    COST.dit_train(model, len(n.samples), span, tokens, False, 3, SPEC.micro_batch)
                )
            elif n.kind == Kind.LOGPROB:
                assert n.cost_s == pytest.approx(
                    COST.dit_logprob(model, len(n.samples), SPEC.trained_timesteps, tokens, False, 3, SPEC.micro_batch)
                )
        trained = [sample for n in nodes if n.kind == Kind.TRAIN for sample in n.samples]
        assert sorted(set(trained)) == sorted({(0, p, i) for p in range(SPEC.prompts) for i in range(SPEC.group)})
    staged = build_flow(SPEC, 1, FlowShape(4, 1, True, 3, staged=True), COST)
    assert [len(n.samples) for n in staged if n.kind == Kind.GENERATE] == [5, 4, 5, 4], (
        "samples split evenly per mini-batch"
    )
    assert sum(n.kind == Kind.LOGPROB for n in staged) == SPEC.mini_batches


def test_diffusion_nft_prices_its_old_policy_forward_and_copy():
    """DiffusionNFT's trainer reads the old policy's velocity at every trained pair, one more forward without
    gradient, and holds the old policy beside its weights: on one bf16 device (no gathers, no casts) a train node
    costs (forward + old policy's forward + backward's 2 + recompute) / (forward + 2 + recompute) = 5/4 of
    FlowGRPO's, and the trainer holds a bf16 copy of the model more, shared out over its devices."""
    nft = SPEC.model_copy(update={"algorithm": "diffusion_nft"})
    shape = FlowShape(2, 5, False, 1)
    grpo_train = {n.id: n.cost_s for n in build_flow(SPEC, 1, shape, COST) if n.kind == Kind.TRAIN}
    nft_train = {n.id: n.cost_s for n in build_flow(nft, 1, shape, COST) if n.kind == Kind.TRAIN}
    assert grpo_train.keys() == nft_train.keys() and grpo_train
    assert all(nft_train[key] == pytest.approx(grpo_train[key] * 5 / 4) for key in grpo_train)
    params = diffusion_model(SPEC.model).params
    for devices in (1, 4):
        held = (
            engines(nft, COST, devices).resident_gb[Role.TRAINER]
            - engines(SPEC, COST, devices).resident_gb[Role.TRAINER]
        )
        assert held == pytest.approx(params * 2 / devices / 1e9)


def test_flow_steps_chain_through_commits_and_mini_batches():
    graph = Graph(build_flow(SPEC, 2, FlowShape(2, 5, True, 3), COST))
    assert "flux/s0/commit0" in graph["flux/s0/train1.t0-5"].deps
    assert "flux/s0/commit1" in graph["flux/s1/train0.t0-5"].deps
    assert "flux/s0/commit1" in graph["flux/s1/logprob1"].deps
    assert graph["flux/s1/gen0"].deps == ()
    assert graph["flux/s0/publish"].deps == ("flux/s0/commit1",)


def test_flow_shape_and_spec_errors_name_the_field():
    with pytest.raises(ValueError, match="tsp_chunk=9"):
        build_flow(SPEC, 1, FlowShape(2, 9, False, 1), COST)
    with pytest.raises(ValueError, match="fragments=3 must be a multiple of mini_batches=2"):
        build_flow(SPEC, 1, FlowShape(3, 1, False, 1), COST)
    with pytest.raises(ValueError, match="trained_timesteps=8"):
        SPEC.model_copy(update={}).model_validate({**SPEC.model_dump(), "trained_timesteps": 8})


def test_planning_never_imports_torch():
    """Planning a large run must work on a laptop: the scheduler stack stays torch-free."""
    import subprocess
    import sys

    code = (
        "import sys, dovetail.graph.flow, dovetail.sched, dovetail.plan.sim, dovetail.plan.metrics;"
        "import dovetail.plan.report;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_fragment_batched_engine_prices_a_piece_of_several_groups_as_one_pass():
    """flow_grpo generates a group per pass; dovetail's engine a whole rollout piece: with three groups in a piece
    (and memory for them), one pass of 9 samples costs less than three of 3 — and a piece of one group the same."""

    def generate_seconds(batching: str, fragments: int) -> float:
        spec = SPEC.model_copy(update={"generation_batch": batching})
        nodes = build_flow(spec, 1, FlowShape(fragments, 1, False, trainer_devices=3), COST)
        return sum(n.cost_s for n in nodes if n.kind == Kind.GENERATE)

    assert generate_seconds("fragment", 2) < generate_seconds("group", 2)
    assert generate_seconds("fragment", 6) == pytest.approx(generate_seconds("group", 6))


def test_digen_ranks_its_cuts_on_an_h100_for_a_gpu_and_on_the_device_itself_for_a_cpu_core():
    """A faster GPU must search every cut a slower one does (so both rank on one GPU); a CPU core has no faster
    device of its platform, and an H100's proportions would pick its cuts for another machine."""
    assert ranking_model(CostModel("H200")).device.name == "H100"
    cpu = CostModel("cpu-core")
    assert ranking_model(cpu) is cpu


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_s_spec_and_shape_answer_what_the_planner_asks_of_them(name):
    """A kind's spec and shape implement every abstract member of their contract (`graph.spec._PipelineSpec`,
    `graph.shape.Shape`): a policy asks them, never which kind they are."""
    spec, shape = KINDS[name].load("spec"), KINDS[name].load("shape")
    assert issubclass(shape, Shape) and not inspect.isabstract(shape)
    assert not inspect.isabstract(spec)


LM_SPEC = LMSpec(**planner_scenarios.lm_pipeline(length_bands=[256, 1024]))
CUTS: list[tuple[PipelineSpec, Shape]] = [
    (SPEC, FlowShape(2, 1, True, trainer_devices=3)),
    (SPEC, FlowShape(6, 5, False, trainer_devices=2, staged=True)),
    (LM_SPEC, LMShape(4, 2)),
    (LM_SPEC, LMShape(3, 4, migrate_at=256, tail_parallel=2, stream=True)),
    (LM_SPEC.model_copy(update={"tensor_parallel": 2}), LMShape(2, 4, migrate_at=1024)),
]


@pytest.mark.parametrize(("spec", "shape"), CUTS)
def test_what_a_shape_and_its_spec_say_of_themselves_is_what_they_build(spec, shape):
    """`Shape.rollout_engines`, `rollout_kind`, `tails_migrate` and `PipelineSpec.rollout_engine_devices` against the
    nodes the shape builds: rollout nodes on engines carry their engine's shard (one per engine) and spread over at
    most the engine's devices; pieces that may run anywhere carry none; a tail migrates only where the shape says
    one may; the rollout's bulk is of its `rollout_kind`."""
    nodes = shape.build(spec, 2, COST)
    rollout = [n for n in nodes if n.role == Role.ROLLOUT]
    kinds = [n.kind for n in rollout]
    assert max(kinds.count(kind) for kind in set(kinds)) == kinds.count(shape.rollout_kind)
    home = [n for n in rollout if n.shard is not None]
    if shape.rollout_engines is None:
        assert not home
    else:
        assert {n.shard for n in home} == set(range(shape.rollout_engines))
        assert {n.max_width for n in home} == {spec.rollout_engine_devices}
    migrated = any(n.kind == Kind.MIGRATE for n in nodes)
    assert migrated <= shape.tails_migrate
