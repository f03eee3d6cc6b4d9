"""A run directory: config.yaml, metrics.jsonl, summary.json, eval grids and checkpoints/step_{k:06d}/."""

import json
from pathlib import Path

import numpy as np
import torch

from dovetail.models.t2i import load_model, save_model


class RunDir:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"

    def start_fresh(self) -> None:
        """A new run in an existing directory replaces its metrics and summary (checkpoints stay)."""
        for name in ("metrics.jsonl", "summary.json"):
            (self.path / name).unlink(missing_ok=True)

    def write_config(self, text: str) -> None:
        (self.path / "config.yaml").write_text(text)

    def append_metrics(self, metrics: dict) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def read_metrics(self) -> list[dict]:
        path = self.path / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def read_summary(self) -> dict:
        path = self.path / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def write_summary(self, summary: dict) -> None:
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))

    def save_eval_grid(self, images: np.ndarray, prompts: list[str], name: str) -> None:
        """One column per prompt, its samples down the column: tiled into one image and drawn once, because the
        driver pauses training while it draws (80 subplots took 1.6 s, this takes a tenth of that)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        columns = sorted(set(prompts))
        size, pad = images.shape[-1], 1
        rows = max(prompts.count(p) for p in columns)
        grid = np.ones((rows * (size + pad) + pad, len(columns) * (size + pad) + pad))
        filled = dict.fromkeys(columns, 0)
        for image, prompt in zip(images, prompts):
            row, column = filled[prompt], columns.index(prompt)
            filled[prompt] += 1
            top, left = pad + row * (size + pad), pad + column * (size + pad)
            grid[top : top + size, left : left + size] = 1 - image
        fig, ax = plt.subplots(figsize=(len(columns) * 0.8, rows * 0.8 + 0.4))
        ax.imshow(grid, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xticks([pad + c * (size + pad) + size / 2 - 0.5 for c in range(len(columns))], columns, fontsize=7)
        ax.set_yticks([])
        ax.xaxis.tick_top()
        fig.tight_layout()
        fig.savefig(self.path / name, dpi=110)
        plt.close(fig)

    def save_checkpoint(
        self, step: int, model, optimizer: torch.optim.Optimizer, extra: dict | None = None, save_weights=None
    ) -> Path:
        """`save_weights(directory)` writes the model in its own format (default: the flow model's)."""
        directory = self.checkpoints / f"step_{step:06d}"
        if save_weights is None:
            save_model(model, directory)
        else:
            save_weights(directory)
        torch.save(optimizer.state_dict(), directory / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state()}, directory / "rng.pt")
        (directory / "state.json").write_text(json.dumps({"step": step} | (extra or {})))
        return directory

    def latest_checkpoint(self) -> Path | None:
        found = sorted(self.checkpoints.glob("step_*/state.json"))
        return found[-1].parent if found else None

    @staticmethod
    def resolve_checkpoint(path: Path | str) -> Path:
        """A checkpoint directory, or a run directory meaning its latest checkpoint."""
        path = Path(path)
        if (path / "state.json").exists():
            return path
        latest = RunDir(path).latest_checkpoint() if path.is_dir() else None
        if latest is None:
            raise FileNotFoundError(f"no checkpoint at {path}: expected RUN_DIR or RUN_DIR/checkpoints/step_NNNNNN")
        return latest

    def load_checkpoint(self, path: Path | str, model, optimizer: torch.optim.Optimizer, load_weights=None) -> int:
        """Restore weights, optimizer and RNG state in place; returns the number of steps done. `load_weights(dir)`
        reads the model of a checkpoint in its own format (default: the flow model's)."""
        directory = self.resolve_checkpoint(path)
        model.load_state_dict((load_weights or load_model)(directory).state_dict())
        optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
        torch.set_rng_state(torch.load(directory / "rng.pt", weights_only=True)["torch"])
        return json.loads((directory / "state.json").read_text())["step"]
