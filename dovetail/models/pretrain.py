"""Rectified-flow pretraining of the tiny text-to-image model on scikit-learn's digits.

Deliberately short: the base model should draw digit-like blobs that the judge often cannot
read, so that RL has room to improve it.
"""

import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits

from dovetail.models.t2i import T2IConfig, TinyT2I, save_model


def digits_dataset() -> tuple[torch.Tensor, list[str]]:
    """Images scaled to [-1, 1] of shape (N, 1, 8, 8) and their prompts "digit N"."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    return images, [f"digit {t}" for t in digits.target]


def pretrain_digits(
    out: Path,
    *,
    steps: int = 400,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    config: T2IConfig | None = None,
) -> TinyT2I:
    torch.manual_seed(seed)
    images, prompts = digits_dataset()
    model = TinyT2I(config or T2IConfig())
    prompt_ids = model.encode_prompts(prompts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    start = time.time()
    for step in range(steps):
        rows = torch.randint(0, len(images), (batch_size,), generator=generator)
        x0 = images[rows]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = torch.sigmoid(torch.randn(batch_size, generator=generator))  # logit-normal, as SD3
        x_sigma = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
        loss = torch.nn.functional.mse_loss(model(x_sigma, sigma, prompt_ids[rows]), noise - x0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"pretrain step {step:5d}  loss {loss.item():.4f}  {time.time() - start:6.1f}s", flush=True)
    model.eval()
    save_model(model, Path(out))
    return model
