"""dovetail: RL post-training for generative models that keeps every device busy.

The Python API, as the command line does it:

    import dovetail

    class Watch:
        def on_step(self, metrics, pipeline):       # each metrics.jsonl line, as it is written
            print(pipeline, metrics["step"], metrics["reward/total"])

        def on_eval(self, evaluation, pipeline):    # dovetail.trackers.Evaluation: step, scores, image / samples
            print(evaluation.caption, evaluation.image)

    summary = dovetail.train("configs/digits.yaml", out="runs/api", steps=20, callbacks=[Watch()])
    table = dovetail.simulate("jigsaw-qwen3-4b-8xh100", policies=["verl-sync", "jigsaw"], steps=4)
"""

from dovetail.api import simulate, train

__version__ = "0.1.0"
__all__ = ["simulate", "train"]
