"""`verl-sync`: verl's synchronous hybrid engine for LM GRPO.

Every device of a pipeline's group holds the rollout engine, generates its shard, and the whole group
waits for the longest response (stage barrier). A step that draws more prompts (dynamic sampling, `draws`) scores
each draw before it rolls out the next (DAPO's recipe in verl: generate, filter, generate again).
Then: reward -> sleep rollout / wake trainer -> old log-probs -> reference log-probs -> (PPO: the critic's values,
the critic's update) -> actor update (micro-batches) -> optimizer step -> weight sync -> wake rollout -> next step.
Several pipelines split the pool evenly and each runs this way.
"""

from __future__ import annotations

from collections.abc import Sequence

from dovetail.graph.lm import LMShape, stage
from dovetail.graph.node import Role
from dovetail.graph.spec import PipelineSpec
from dovetail.sched.lm_common import (
    StagedLMPolicy,
    lm_only,
    rollout_engines,
    split_pool,
    stage_nodes,
    step_done,
    tensor_parallel,
)
from dovetail.sched.policy import Begin, Decision, Event, StartStep, View

ORDER = ("rollout", "score", "old", "ref", "values", "critic", "train", "commit", "publish")
"""verl's order of a step's stages (`ray_trainer.fit`): PPO's critic computes its values after the reference's
log-probs and trains before the actor."""


class VerlSync(StagedLMPolicy):
    name = "verl-sync"
    splits_pool = True
    fixes = {"trainer_devices": "trains on every device of a pipeline's slice (hybrid engine)"}

    @classmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost) -> LMShape:
        spec = lm_only(cls.name, spec)
        return LMShape(rollout_engines(spec, devices), devices)

    def decide(self, view: View, events: Sequence[Event]) -> list[Decision]:
        pipelines = view.graph.pipelines()
        groups = dict(zip(pipelines, split_pool(self.setup.devices, len(pipelines))))
        decisions: list[Decision] = []
        for pipeline, group in groups.items():
            decisions += self._pipeline(view, pipeline, group, any(isinstance(e, Begin) for e in events))
        return decisions

    def _pipeline(self, view: View, pipeline: str, group: tuple[int, ...], begin: bool) -> Sequence[Decision]:
        steps = view.graph.steps(pipeline)
        open_steps = [s for s in steps if (pipeline, s) in view.started]
        step = max(open_steps, default=None)
        if step is None or step_done(view, pipeline, step, "publish"):
            following = steps[0] if step is None else step + 1
            if following not in steps:
                return []
            switches = self.switch_group(view, pipeline, group, Role.ROLLOUT)
            if switches or not self.free(view, group, Role.ROLLOUT):
                return switches
            return [StartStep(pipeline, following, view.published[pipeline])]
        stages = stage_nodes(view.graph, pipeline, step)
        ready = [n for n in self.ready_nodes(view, pipeline) if n.step == step]
        current = next(name for name in ORDER if any(n not in view.finished for n in stages.get(name, ())))
        rolling = any(stage(view.graph[n]) == "rollout" for n in view.running if view.graph[n].pipeline == pipeline)
        if current == "rollout" and not rolling and all(stage(n) != "rollout" for n in ready):
            # a step that draws more prompts (dynamic sampling, `draws`): its next draw's rollout waits on the score
            # of the draw before (no rollout runs or is ready), which runs first
            current = "score"
        if current == "rollout":
            return self.place_rollout(view, group, tensor_parallel(view, pipeline, group), ready)
        if current == "score":
            return self.run_scores(view, ready, group)
        switches = self.switch_group(view, pipeline, group, Role.TRAINER)
        if switches or not self.free(view, group, Role.TRAINER):
            return switches
        return self.run_trainer_stage(view, pipeline, step, group, ready, current)
