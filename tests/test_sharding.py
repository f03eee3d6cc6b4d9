"""Sharded trainers (`models.sharding`, FSDP2) against the replicated trainer they stand in for, on two gloo processes:
each holds half a replica's bytes (counted from its tensors), fp32 training ends where the replica's does (within
rounding: the gradient reduction adds in another order), bf16 tracks fp32 on a step and keeps fp32 master weights,
checkpoints move between one device and two, and the full weights gathered for publication are the replica's.

One spawn of two processes runs every sharded experiment (each process start costs seconds of imports on two cores);
the replicated reference runs in the test process itself, which is also the one-device trainer that writes and reads
the checkpoints of the 1 -> 2 and 2 -> 1 moves (DCP without a process group)."""

import socket
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dovetail.models import sharding
from dovetail.models.lm import LMConfig, build_lm
from dovetail.models.memory import memory_by_kind
from dovetail.models.t2i import T2IConfig, TinyT2I
from dovetail.models.training import commit, trainer_state_of

pytestmark = pytest.mark.slow

torch.set_num_threads(1)

WORLD, STEPS, RESUME_AT, BATCH = 2, 4, 2, 4
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 0.1, 0.5
TRAIN = SimpleNamespace(lr=LR, max_grad_norm=MAX_GRAD_NORM, lr_schedule="constant", warmup_steps=0, steps=STEPS)
"""What `commit` reads of a config's `train` section."""
LM = LMConfig(task="sort", vocab_size=41, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)
"""An odd vocabulary: the tied embedding's 41 rows shard 21 / 20, the uneven case."""
FLOW = T2IConfig(num_layers=2, num_heads=2, head_dim=8, text_dim=16)

FP32_BOUND = 1e-5
"""A sharded fp32 run's largest parameter difference from the replica's: the bound every synchronous flow policy
keeps against the reference loop (docs/architecture.md, "Exactness"). The reduce-scatter averages the two halves'
gradients where the replica's backward sums the whole batch, so the bits differ by rounding, which AdamW's steps
carry (here ~5e-7, and ~7e-7 under the Makefile's OTHER_KERNELS)."""
BF16_BOUND = 2e-2
"""bf16 compute against fp32: a loss and a gradient norm within bf16's ~3 significant digits."""


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_lm(LM) if kind == "lm" else TinyT2I(FLOW)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def loss_of(kind: str, model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    """Step `step`'s loss on this rank's rows of the batch: next-token cross-entropy on random tokens, or the flow
    matching loss on random images. Every rank has as many rows (and tokens), so the mean of the ranks' losses is the
    whole batch's."""
    generator = torch.Generator().manual_seed(step)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    if kind == "lm":
        ids = torch.randint(3, LM.vocab_size, (BATCH, 12), generator=generator)[rows]
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    images = torch.rand(BATCH, 1, FLOW.image_size, FLOW.image_size, generator=generator) * 2 - 1
    noise = torch.randn(images.shape, generator=generator)
    sigma = torch.rand((), generator=generator)
    digits = torch.randint(0, 10, (BATCH,), generator=generator).tolist()
    prompts = model.encode_prompts([f"digit {d}" for d in digits])
    noisy = (1 - sigma) * images + sigma * noise
    predicted = model(noisy[rows], sigma, prompts[rows])
    return torch.nn.functional.mse_loss(predicted, (noise - images)[rows])


def train(kind, model, optimizer, steps: range, rank: int = 0, world: int = 1) -> list[tuple[float, float]]:
    """AdamW steps with the gradient norm clipped (`training.commit`, the trainers' own); each step's loss on this
    rank and pre-clip gradient norm (the whole model's, also when sharded)."""
    trace = []
    for step in steps:
        loss = loss_of(kind, model, step, rank, world)
        loss.backward()
        trace.append((float(loss.detach()), commit(model, optimizer, TRAIN)))
    return trace


def held(kind, model, optimizer, rank: int = 0, world: int = 1) -> dict[str, int]:
    """Bytes by kind while parameters, gradients and optimizer state are all there: after a backward of the step
    past the last, whose gradients are then dropped."""
    loss_of(kind, model, STEPS, rank, world).backward()
    memory = memory_by_kind(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    return memory


def numpy_bytes(state) -> int:
    """The bytes of the numpy arrays in a trainer state: what a trainer hands to Ray's object store."""
    if isinstance(state, np.ndarray):
        return state.nbytes
    if isinstance(state, dict):
        return sum(numpy_bytes(v) for v in state.values())
    if isinstance(state, list):
        return sum(numpy_bytes(v) for v in state)
    return 0


def full(model) -> dict[str, torch.Tensor]:
    return dict(sharding.full_weights(model))


def max_difference(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference over the whole state, which must hold the same tensors."""
    assert list(weights) == list(reference)
    assert all(weights[k].shape == reference[k].shape and weights[k].dtype == reference[k].dtype for k in reference)
    return max(float((weights[k] - reference[k]).abs().max()) for k in reference)


# ------------------------------------------------------------------------------------- the two sharded processes


def sharded_experiments(rank: int, directory) -> dict:
    """Everything the tests read from the sharded side, on this rank."""
    mesh = sharding.device_mesh("cpu")
    results: dict = {}

    model = sharding.shard(build("lm"), mesh)
    results["initial"] = full(model)
    optimizer = adamw(model)
    results["lm_trace"] = train("lm", model, optimizer, range(RESUME_AT), rank, WORLD)
    sharding.save_checkpoint(model, optimizer, directory / "written_on_2")
    state = sharding.local_state(model, optimizer)
    results["local_state_bytes"] = numpy_bytes(state)
    results["lm_trace"] += train("lm", model, optimizer, range(RESUME_AT, STEPS), rank, WORLD)
    results["lm"] = full(model)
    results["memory"] = held("lm", model, optimizer, rank, WORLD)
    results["block_bytes"] = sum(p.numel() * p.element_size() for p in build("lm").model.layers[0].parameters())

    def resumed(load) -> dict[str, torch.Tensor]:
        """A fresh trainer (other initial weights, no optimizer state) given step RESUME_AT's state, trained on."""
        restarted = sharding.shard(build("lm", seed=1), mesh)
        restarted_optimizer = adamw(restarted)
        load(restarted, restarted_optimizer)
        train("lm", restarted, restarted_optimizer, range(RESUME_AT, STEPS), rank, WORLD)
        return full(restarted)

    results["from_local_state"] = resumed(lambda m, o: sharding.load_local_state(m, o, state))
    results["from_2"] = resumed(lambda m, o: sharding.load_checkpoint(m, o, directory / "written_on_2"))
    results["from_1"] = resumed(lambda m, o: sharding.load_checkpoint(m, o, directory / "written_on_1"))

    flow = sharding.shard(build("flow"), mesh, activation_checkpointing=True)
    flow_optimizer = adamw(flow)
    train("flow", flow, flow_optimizer, range(STEPS), rank, WORLD)
    results["flow"] = full(flow)
    # what a trainer keeps beside its model: a second trained model (PPO's critic), an elementwise average (an EMA),
    # here the flow model and the language model's own weights
    parameters = dict(model.named_parameters())
    results["beside"] = sharding.local_state(model, optimizer) | {
        "critic": sharding.local_state(flow, flow_optimizer),
        "ema": sharding.local_tensors(parameters),
        "rank": rank,
    }
    results["cut_again"] = all(
        torch.equal(sharding.local_of_whole(p, results["lm"][name]).to_local(), p.to_local())
        for name, p in parameters.items()
    )

    bf16 = sharding.shard(build("lm"), mesh, precision="bf16", activation_checkpointing=True)
    computed_in = []
    bf16.model.layers[0].mlp.up_proj.register_forward_pre_hook(lambda m, _: computed_in.append(m.weight.dtype))
    bf16_optimizer = adamw(bf16)
    loss = loss_of("lm", bf16, 0, rank, WORLD)
    loss.backward()
    results["bf16_dtypes"] = {
        "computed in": set(computed_in),
        "loss": loss.dtype,
        "parameters": {p.dtype for p in bf16.parameters()},
        "gradients": {p.grad.dtype for p in bf16.parameters()},
    }
    results["bf16_trace"] = [(float(loss.detach()), commit(bf16, bf16_optimizer, TRAIN))]
    results["bf16_dtypes"]["optimizer"] = {v.dtype for s in bf16_optimizer.state.values() for v in s.values()}

    hybrid = sharding.shard(build("lm"), sharding.device_mesh("cpu", group_size=1))
    hybrid_optimizer = adamw(hybrid)
    results["hybrid_mesh"] = hybrid.model.embed_tokens.weight.device_mesh.mesh_dim_names
    train("lm", hybrid, hybrid_optimizer, range(STEPS), rank, WORLD)
    results["hybrid"] = full(hybrid)

    errors = []
    for attempt in (
        lambda: sharding.device_mesh("cpu", group_size=3),
        lambda: sharding.load_local_state(model, optimizer, sharding.local_state(hybrid, hybrid_optimizer)),
    ):
        with pytest.raises(ValueError) as error:
            attempt()
        errors.append(str(error.value))
    results["errors"] = errors
    return results


def rank_main(rank: int, port: int, directory) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}")
    try:
        torch.save(sharded_experiments(rank, directory), directory / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------- the replica and the spawn


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharding")
    replica = build("lm")
    initial = {k: v.clone() for k, v in replica.state_dict().items()}
    optimizer = adamw(replica)
    trace = train("lm", replica, optimizer, range(RESUME_AT))
    sharding.save_checkpoint(replica, optimizer, directory / "written_on_1")
    state_bytes = numpy_bytes(trainer_state_of(replica, optimizer))
    trace += train("lm", replica, optimizer, range(RESUME_AT, STEPS))
    lm = {k: v.clone() for k, v in replica.state_dict().items()}
    memory = held("lm", replica, optimizer)

    flow = build("flow")
    train("flow", flow, adamw(flow), range(STEPS))

    mp.spawn(rank_main, args=(free_port(), directory), nprocs=WORLD)
    ranks = [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    from_2 = build("lm", seed=1)
    from_2_optimizer = adamw(from_2)
    sharding.load_checkpoint(from_2, from_2_optimizer, directory / "written_on_2")
    train("lm", from_2, from_2_optimizer, range(RESUME_AT, STEPS))
    return SimpleNamespace(
        initial=initial,
        lm=lm,
        trace=trace,
        memory=memory,
        state_bytes=state_bytes,
        flow=flow.state_dict(),
        on_1_from_2=from_2.state_dict(),
        ranks=ranks,
    )


def test_a_two_device_group_holds_half_a_replicas_bytes_on_each_device(runs):
    block = runs.ranks[0]["block_bytes"]
    per_kind_block = {"parameters": block, "gradients": block, "optimizer": 2 * block}
    for kind, replica_bytes in runs.memory.items():
        held_by = [r["memory"][kind] for r in runs.ranks]
        assert all(abs(b - replica_bytes / WORLD) <= per_kind_block[kind] for b in held_by), (kind, held_by)
    # The shards partition the model: what the ranks hold adds up to the replica's parameters and gradients.
    for kind in ("parameters", "gradients"):
        assert sum(r["memory"][kind] for r in runs.ranks) == runs.memory[kind]
    # What a trainer would hand to the object store shrinks alike.
    assert all(abs(r["local_state_bytes"] - runs.state_bytes / WORLD) <= 3 * block for r in runs.ranks)


def test_fp32_sharded_training_ends_at_the_replicated_runs_parameters(runs):
    sharded = runs.ranks[0]
    assert max_difference(sharded["lm"], runs.lm) <= FP32_BOUND
    assert max_difference(sharded["flow"], runs.flow) <= FP32_BOUND  # with activation checkpointing
    assert max_difference(runs.lm, runs.initial) > 100 * FP32_BOUND  # the runs moved the parameters
    for step, (loss, norm) in enumerate(runs.trace):
        rank_losses = [r["lm_trace"][step][0] for r in runs.ranks]
        assert np.mean(rank_losses) == pytest.approx(loss, rel=1e-6)
        assert all(r["lm_trace"][step][1] == pytest.approx(norm, rel=1e-6) for r in runs.ranks)
    assert runs.trace[0][1] > MAX_GRAD_NORM  # the clip acted, on the norm of the whole sharded gradient


def test_bf16_tracks_fp32_on_one_step_with_fp32_master_weights_and_optimizer_state(runs):
    for r in runs.ranks:
        (bf16_loss, bf16_norm), (fp32_loss, fp32_norm) = r["bf16_trace"][0], r["lm_trace"][0]
        assert bf16_loss == pytest.approx(fp32_loss, rel=BF16_BOUND)
        assert bf16_norm == pytest.approx(fp32_norm, rel=BF16_BOUND)
        assert r["bf16_dtypes"] == {
            "computed in": {torch.bfloat16},
            "loss": torch.float32,
            "parameters": {torch.float32},
            "gradients": {torch.float32},
            "optimizer": {torch.float32},
        }


def test_checkpoints_and_local_state_resume_on_another_device_count(runs):
    sharded = runs.ranks[0]
    # Same processes, same mesh: the restored trainer computes the same bits as the one that went on.
    for resumed in ("from_local_state", "from_2"):
        assert all(torch.equal(sharded[resumed][k], sharded["lm"][k]) for k in sharded["lm"]), resumed
    # Across device counts the restored state is the same; the sums after it round as the new count's do.
    assert max_difference(runs.on_1_from_2, runs.lm) <= FP32_BOUND
    assert max_difference(sharded["from_1"], runs.lm) <= FP32_BOUND


def test_what_a_trainer_keeps_beside_its_model_merges_by_entry_and_cuts_again(runs):
    """A member's state with a second model's local state beside its own (PPO's critic) and tensors of its
    parameters' shapes (an EMA): `merged_state` joins the second into a trainer state, the tensors into whole ones by
    name, keeps any other entry as the first member's; `local_of_whole` cuts a whole tensor back into a member's
    shard."""
    merged = sharding.merged_state([r["beside"] for r in runs.ranks])
    assert set(merged) == {"weights", "optimizer", "critic", "ema", "rank"} and merged["rank"] == 0
    sharded = runs.ranks[0]
    assert merged["critic"]["weights"].keys() == sharded["flow"].keys()
    assert all(np.array_equal(merged["critic"]["weights"][k], sharded["flow"][k].numpy()) for k in sharded["flow"])
    assert len(merged["critic"]["optimizer"]["state"]) == len(list(build("flow").parameters()))
    assert all(np.array_equal(merged["ema"][k], sharded["lm"][k].numpy()) for k in merged["ema"])
    assert merged["ema"].keys() == {k for k, _ in build("lm").named_parameters()}
    assert all(r["cut_again"] for r in runs.ranks)


def test_the_gathered_full_weights_are_the_replicas_state_dict(runs):
    for r in runs.ranks:
        assert list(r["initial"]) == list(runs.initial)
        assert all(torch.equal(r["initial"][k], runs.initial[k]) for k in runs.initial)


def test_a_hybrid_mesh_replicating_across_groups_trains_as_the_replica(runs):
    assert runs.ranks[0]["hybrid_mesh"] == ("replicate", "shard")
    assert max_difference(runs.ranks[0]["hybrid"], runs.lm) <= FP32_BOUND


def test_bad_shapes_are_one_line_naming_the_fix(runs, tmp_path):
    group_size, local_state = runs.ranks[0]["errors"]
    assert group_size == "group_size=3 does not divide the 2 trainer devices: give a divisor of 2"
    assert local_state.startswith("trainer state model.embed_tokens.weight holds a shard of shape (41, 32) where")
    with pytest.raises(ValueError, match=r"precision='fp16' is not one of \('fp32', 'bf16'\)"):
        sharding.mixed_precision("fp16")
    with pytest.raises(FileNotFoundError, match="no sharded checkpoint in"):
        sharding.load_checkpoint(build("lm"), adamw(build("lm")), tmp_path)
