"""PPO's critic for a language model: the policy's transformer with a scalar value head in place of its language-model
head, as verl builds it (`AutoModelForTokenClassification` with one label, loaded from the actor's checkpoint: the
body's weights are the policy's, the head is new) and OpenRLHF's `get_llm_for_sequence_regression` does.
"""

import copy

import torch

from dovetail.graph.node import sample_key
from dovetail.models.causal_lm import CausalLM
from dovetail.models.training import with_lora


class ValueModel(torch.nn.Module):
    """V(s_t) at every position: the body's last hidden state times a (hidden -> 1) head."""

    def __init__(self, body: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The value (B, L) of each position's prefix, in fp32."""
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden.float()).squeeze(-1).float()


def value_model_of(policy: torch.nn.Module, seed: int, lora: dict | None = None) -> ValueModel:
    """A critic started from `policy`'s weights (a copy of its transformer body, the language-model head left out)
    with a fresh head: weights drawn from N(0, initializer_range^2) and a zero bias, as transformers initialises a
    token-classification head, from a generator keyed by the run's seed, so every device and the reference loop
    start the same critic. A LoRA policy's critic is a whole model on the adapter's base weights, as verl's critic
    takes no adapter of the actor's: every weight of its body trains. With `lora` (critic.lora: rank, alpha,
    target_modules) the critic's own adapter goes on its body, seeded apart from the policy's, and the adapter and
    the head alone train (verl's critic with lora_rank, whose token-classification head peft keeps trainable)."""
    causal = policy.model if isinstance(policy, CausalLM) else policy
    if isinstance(policy, CausalLM) and policy.lora:  # the adapter's base: the critic trains a whole model
        causal = copy.deepcopy(causal).merge_and_unload()
        causal.load_state_dict(policy.base_weights)
    body = copy.deepcopy(causal.base_model)
    config = causal.config
    critic = ValueModel(body, config.hidden_size).to(next(policy.parameters()).device)
    generator = torch.Generator().manual_seed(sample_key("critic-head", seed))
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        head = torch.randn(critic.head.weight.shape, generator=generator, dtype=torch.float32) * std
        critic.head.weight.copy_(head.to(critic.head.weight.dtype))
        critic.head.bias.zero_()
    critic = critic.float().requires_grad_(True)
    if lora is not None:  # the body frozen under its adapter; the head trains whole
        critic.body = with_lora(critic.body, lora, sample_key("critic-lora", seed))
    return critic
