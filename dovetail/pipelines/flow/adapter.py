"""The driver's side of a flow pipeline on the Ray runtime: `FlowAdapter` turns a node of `graph.flow` into typed
work for the devices the policy chose (generate, score, old log-probs, train), books what comes back in the ledger,
and reports a committed step's figures.
"""

from __future__ import annotations

import numpy as np

from dovetail.graph.flow import FlowShape
from dovetail.graph.node import Kind, Node, SampleId
from dovetail.models.flow_rl import recompute_passes, step_prompts, training_passes
from dovetail.pipelines.flow.config import FlowTrainConfig, flow_rules
from dovetail.pipelines.flow.messages import FlowLogProbs, FlowTrain, Generate, Trajectories
from dovetail.pipelines.flow.recipe import sample_timesteps
from dovetail.prompts import train_prompts
from dovetail.runtime.messages import FurtherUpdate, Score, Scores, Trained
from dovetail.runtime.pipeline import Part, PipelineAdapter, RunContext

STAT_MEANS = ("clip_frac", "approx_kl", "ratio_mean", "loss", "kl_ref", "optimality_mean", "old_deviation")
"""Loss statistics the train parts sum over their (sample, timestep) pairs, reported as means."""


class FlowAdapter(PipelineAdapter):
    """The driver side of a flow pipeline: node -> typed work per device, results -> the sample ledger."""

    def __init__(self, config: FlowTrainConfig, first_step: int) -> None:
        super().__init__(config, first_step)
        self.rules = flow_rules(config)
        self._prompts: dict[int, list[str]] = {}

    def units_of(self, sample: SampleId) -> list[int]:
        """Positions in the sample's trained timesteps (`sample_timesteps`): the engines look the timesteps up
        from the sample's identity, so samples that train different timesteps share one train node's chunk."""
        return list(range(self.rules.trained_timesteps))

    def parts(self, node: Node, devices: tuple[int, ...], run: RunContext) -> list[Part]:
        step = self.rl_step(node)
        pipeline = node.pipeline
        if node.kind == Kind.GENERATE:
            prompts = self._prompts.setdefault(
                step,
                step_prompts(self.config.seed, step, self.config.algo.prompts_per_step, train_prompts(self.config)),
            )
            samples = [SampleId(step, p, i) for (_, p, i) in node.samples]
            version = run.rollout_version(pipeline, node.step)
            weights = run.weights(pipeline, version)
            return [
                Part(
                    node.id,
                    device,
                    Generate(pipeline, ids, [prompts[s.prompt] for s in ids], self.first_step + version, weights),
                )
                for device, ids in self.spread(samples, devices)
            ]
        sources = run.sources(node, (Kind.GENERATE, Kind.SCORE, Kind.LOGPROB))
        trajectories = sources[Kind.GENERATE]
        if node.kind == Kind.SCORE:
            return [Part(node.id, d, Score(pipeline, refs)) for d, refs in self.spread(trajectories, devices)]
        units = list(range(self.rules.trained_timesteps))
        sharded = self.config.train.sharding == "fsdp"
        group_size = flow_shape(run.shape_of(pipeline)).group
        if node.kind == Kind.LOGPROB and sharded:
            samples = [SampleId(step, p, i) for (_, p, i) in node.samples]

            def forwards(ids: list[SampleId]) -> int:
                return recompute_passes([[sample_timesteps(self.config, s)[u] for u in units] for s in ids])

            return [
                Part(node.id, d, FlowLogProbs(pipeline, units, trajectories, ids, group=group, passes=passes))
                for d, ids, group, passes in self.lockstep(samples, devices, group_size, forwards)
            ]
        if node.kind == Kind.LOGPROB:
            return [
                Part(node.id, d, FlowLogProbs(pipeline, units, refs)) for d, refs in self.spread(trajectories, devices)
            ]
        if node.kind == Kind.TRAIN:
            assert node.timesteps is not None, "a flow train node carries its timestep chunk (`graph.flow`)"
            chunk = units[node.timesteps[0] : node.timesteps[1]]
            samples = [SampleId(step, p, i) for (_, p, i) in node.samples]
            stale = run.rollout_version(pipeline, node.step) < node.version
            chunk_size = self.config.train.chunk_size
            shares = (
                self.lockstep(
                    samples, devices, group_size, lambda ids: training_passes(len(ids) * len(chunk), chunk_size)
                )
                if sharded
                else [(d, ids, (), 0) for d, ids in self.spread(samples, devices)]
            )
            return [
                Part(
                    node.id,
                    device,
                    FlowTrain(
                        pipeline,
                        ids,
                        chunk,
                        self.rules.pairs_per_step,
                        stale,
                        trajectories,
                        sources[Kind.SCORE],
                        sources[Kind.LOGPROB],
                        group=group,
                        passes=passes,
                    ),
                )
                for device, ids, group, passes in shares
            ]
        raise ValueError(f"node {node.id}: a flow pipeline does not run {node.kind} nodes")

    def lockstep(
        self, samples: list[SampleId], devices: tuple[int, ...], group_size: int, passes_of
    ) -> list[tuple[int, list[SampleId], tuple[int, ...], int]]:
        """A sharded trainer's node on `devices`: (device, its samples, its FSDP group, the group's passes) for
        every device. The devices are cut into consecutive FSDP groups of `group_size` (the shape's: one group over
        them all, or HYBRID groups of a node, each a replica of the trainer), the samples shared out to the groups
        and within each to its members; every member of a group makes as many passes (`passes_of` its samples) as
        the one with the most."""
        groups = consecutive_groups(devices, group_size)
        by_group = dict(self.spread(samples, tuple(range(len(groups)))))
        shares = []
        for index, group in enumerate(groups):  # a group without samples takes part too: it passes nothing
            members = self.every_member(self.spread(by_group.get(index, []), group), group)
            passes = max(passes_of(ids) for _, ids in members)
            shares += [(device, ids, group, passes) for device, ids in members]
        return shares

    def fsdp_groups(self, run: RunContext, pipeline: str, devices: tuple[int, ...]) -> list[tuple[int, ...]]:
        return consecutive_groups(devices, flow_shape(run.shape_of(pipeline)).group)

    @staticmethod
    def every_member(shares: list[tuple[int, list]], devices: tuple[int, ...]) -> list[tuple[int, list]]:
        """`shares` (device, items) with an empty share for every device of `devices` that has none, in device
        order: each member of a sharded trainer's group takes part in each of its nodes."""
        held = dict(shares)
        return [(device, held.get(device, [])) for device in sorted(devices)]

    @property
    def updates_per_step(self) -> int:
        return self.config.algo.num_iterations

    def further_metrics(self, further: list[list[FurtherUpdate]]) -> dict:
        return further_update_metrics(further)

    def step_metrics(self, scores: list[Scores], trained: list[Trained]) -> dict:
        pairs = sum(len(t.samples) * len(t.units) for t in trained)
        metrics: dict[str, float | list[int]] = {
            "reward/total": float(np.concatenate([s.scores["total"] for s in scores]).mean())
        }
        metrics |= {
            name: sum(t.stats[name] for t in trained) / pairs for name in STAT_MEANS if name in trained[0].stats
        }
        if "ratio_min" in trained[0].stats:  # a policy ratio's extremes (DiffusionNFT has none)
            metrics["ratio_min"] = min(t.stats["ratio_min"] for t in trained)
            metrics["ratio_max"] = max(t.stats["ratio_max"] for t in trained)
        metrics["timesteps"] = sorted({unit for t in trained for unit in t.units})
        return metrics

    def book(self, node: Node, part: Part, result, ledger) -> None:
        if isinstance(result, Trajectories):
            for sample in result.samples:
                ledger.generated.setdefault(SampleId(*sample), []).append((part.device, result.version))
        elif isinstance(result, Scores):
            for sample in result.samples:
                ledger.scored[SampleId(*sample)] = ledger.scored.get(SampleId(*sample), 0) + 1


def further_update_metrics(further: list[list[FurtherUpdate]]) -> dict:
    """The updates after a step's first (algo.num_iterations), each as `update_K/...` (K = 2, 3, ...): its pre-clip
    `grad_norm` and its parts' loss statistics as means over their (sample, timestep) pairs (`clip_frac`,
    `ratio_mean`, `approx_kl`, `loss`) with the ratio's extremes, from every trainer device's answer (`further`: per
    device, its updates in order). The step's own figures are its first update's."""
    metrics: dict[str, float] = {}
    for index, updates in enumerate(zip(*further)):
        trained = [t for update in updates for t in update.trained]
        pairs = sum(len(t.samples) * len(t.units) for t in trained)
        figures = {"grad_norm": float(updates[0].grad_norm)}
        figures |= {
            name: sum(t.stats[name] for t in trained) / pairs for name in STAT_MEANS if name in trained[0].stats
        }
        figures["ratio_min"] = min(t.stats["ratio_min"] for t in trained)
        figures["ratio_max"] = max(t.stats["ratio_max"] for t in trained)
        metrics |= {f"update_{index + 2}/{name}": value for name, value in figures.items()}
    return metrics


def flow_shape(shape) -> FlowShape:
    """A flow pipeline's shape: the planner cuts its steps with a `FlowShape` (`graph.flow`)."""
    assert isinstance(shape, FlowShape), f"a flow pipeline cut by a {type(shape).__name__}"
    return shape


def consecutive_groups(devices: tuple[int, ...], group_size: int) -> list[tuple[int, ...]]:
    """`devices` in order, cut into consecutive FSDP groups of `group_size` (all of them where fewer)."""
    ordered = sorted(devices)
    size = min(group_size, len(ordered))
    return [tuple(ordered[start : start + size]) for start in range(0, len(ordered), size)]
