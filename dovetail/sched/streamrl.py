"""`streamrl`: StreamRL's disaggregated stream generation for LM GRPO (Zhong et al., 2025).

Each pipeline's devices are split into a rollout pool and a trainer pool, sized so that generation and
training take about as long (they overlap). Finished samples stream to the trainer: micro-batches are
whole prompt groups in the order they finish, and each is scored, gets its old / reference log-probs
and is trained as soon as its responses are done, while the long tail is still decoding (gradients
accumulate, one optimizer step per batch). Asynchronous pipelining: once every rollout node of step s
has started, the rollout pool opens step s + 1 on the latest published weights, never more than one
version behind (staleness <= 1). A step that draws more prompts (dynamic sampling, `draws`) rolls each draw out on
the weights it opened on once the draw before is scored, and trains the groups it keeps after its last draw.
"""

from __future__ import annotations

from dovetail.sched.lm_common import SplitLMPolicy


class StreamRL(SplitLMPolicy):
    name = "streamrl"
    stream = True
