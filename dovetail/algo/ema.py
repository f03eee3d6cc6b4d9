"""An exponential moving average of trained weights, for evaluation (Flow-GRPO's `train.ema`)."""

import torch


class WeightEMA:
    """Flow-GRPO's EMA of the trainable parameters (flow_grpo/ema.py `EMAModuleWrapper`, which train_sd3.py builds
    with decay 0.9 and update_step_interval 8 and steps after every optimizer step; its evaluation swaps the EMA in
    and back out). After optimizer step n (counting from 1), where (n + 1) % every == 0:

        ema <- ema + (1 - d_n) (theta - ema),   d_n = min(decay, (1 + n) / (10 + n))

    the warm-up d_n keeping the first updates close to the weights. It starts as a copy of the weights."""

    def __init__(self, parameters: dict[str, torch.Tensor], decay: float, every: int):
        self.decay, self.every = decay, every
        self.shadow = {name: p.detach().clone() for name, p in parameters.items()}

    def current_decay(self, step: int) -> float:
        return min((1 + step) / (10 + step), self.decay)

    @torch.no_grad()
    def update(self, parameters: dict[str, torch.Tensor], step: int) -> None:
        """After optimizer step `step` (1 for the run's first), with the weights it left."""
        if (step + 1) % self.every != 0:
            return
        one_minus_decay = 1 - self.current_decay(step)
        for name, average in self.shadow.items():
            average.add_(one_minus_decay * (parameters[name].detach().to(average.device) - average))
