"""The paper's LM features for routing: the mean final hidden state of a prefix under the
dense (warm-up) model. Beside the model it reads, so training (dipaco/job/prepare.py) and
inference (dipaco/inference/run.py) both take it from here, neither from the other.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .path_model import PathModel

__all__ = ["lm_featurizer"]


def lm_featurizer(grid: Any, batch_size: int = 64) -> Callable[[list[np.ndarray]], np.ndarray]:
    """Mean final hidden state of each prefix under the dense model (the paper's features)."""
    model = PathModel(grid, 0).eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    max_len = int(grid.cfg.max_seq_len)
    captured: list[torch.Tensor] = []
    # The head's input is the last hidden state; a hook reads it without a second API.
    model.head.register_forward_hook(lambda _m, inp, _out: captured.append(inp[0].detach()))

    @torch.no_grad()
    def featurize(prefixes: list[np.ndarray]) -> np.ndarray:
        out = []
        for start in range(0, len(prefixes), batch_size):
            # a re-route's context can be longer than the model's positions: its last ones
            chunk = [np.asarray(p)[-max_len:] for p in prefixes[start : start + batch_size]]
            T = max(1, max(len(p) for p in chunk))
            x = torch.zeros(len(chunk), T, dtype=torch.long)
            mask = torch.zeros(len(chunk), T)
            for i, p in enumerate(chunk):
                x[i, : len(p)] = torch.as_tensor(np.asarray(p, dtype=np.int64))
                mask[i, : len(p)] = 1.0
            captured.clear()
            model(x.to(device))
            h = captured[0].float().cpu()  # [B, T, C]
            mean = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            out.append(mean.numpy().astype(np.float32))
        return np.concatenate(out, axis=0)

    return featurize
