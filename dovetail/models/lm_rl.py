"""Trainer-side pieces of GRPO for language models: the log-probs of sampled responses under the policy.

The rollout engine records log softmax(logits / temperature)[token] for every token it samples; the
trainer recomputes the same quantity here with the Hugging Face model, under grad, so that on-policy
the GRPO ratio is exactly 1 (up to fp32 rounding; tested against `TorchEngine`).
"""

import torch


def pad_batch(sequences: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into ids (B, L) and a bool mask (B, L) of the real tokens.

    Right padding keeps every real token at its unpadded position (0, 1, ...), so the model needs no
    position ids and the logits of a sequence do not depend on what it is batched with."""
    width = max(map(len, sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        mask[row, : len(sequence)] = True
    return ids, mask


def response_log_probs(
    model, prompts: list[list[int]], responses: list[list[int]], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[token] of every response token given its prompt, in one batched
    forward of `model` (a causal LM returning `.logits`); gradients flow when called under grad.

    Returns (log_probs, mask), both (B, R) with R the longest response: log_probs[b, i] belongs to
    responses[b][i] where mask[b, i], and is 0 elsewhere."""
    device = next(model.parameters()).device
    ids, attention_mask = pad_batch([p + r for p, r in zip(prompts, responses)])
    logits = model(input_ids=ids.to(device), attention_mask=attention_mask.long().to(device)).logits
    targets, mask = pad_batch(responses)
    targets, mask = targets.to(device), mask.to(device)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    # The logits at position i predict token i + 1: response token j is predicted at prompt_length - 1 + j.
    predicting = prompt_lengths[:, None] - 1 + torch.arange(targets.shape[1], device=device)
    predicting = predicting.clamp(max=logits.shape[1] - 1)  # padding columns: any valid row, masked below
    picked = logits.gather(1, predicting[..., None].expand(-1, -1, logits.shape[-1]))
    log_probs = (picked / temperature).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    return log_probs.masked_fill(~mask, 0.0), mask
