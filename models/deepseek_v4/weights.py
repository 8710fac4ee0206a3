"""Weights of :class:`DSV4Attention`: deterministic init from a seed, safetensors save / load."""

from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dsv4_index._common import check_int

__all__ = ["init_weights", "save", "load"]


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Fill every parameter from ``seed`` (CPU generator, name order, so any device gives the same
    values): linear weights ``N(0, 1/fan_in)``, norm weights ``1 + N(0, 0.1)``, sinks ``N(0, 1)``,
    compressor position biases ``N(0, 0.5)``. Returns ``model``."""
    check_int("seed", seed)
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        r = torch.randn(p.shape, generator=g, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("norm", "kv_norm"):
            r = 1.0 + 0.1 * r
        elif leaf == "pos_bias":
            r = 0.5 * r
        elif leaf == "weight":
            r = r * p.shape[1] ** -0.5
        p.copy_(r)
    return model


def save(model: nn.Module, path: Union[str, Path]) -> None:
    """Write every parameter to a safetensors file (CPU, contiguous)."""
    save_file({n: p.detach().cpu().contiguous() for n, p in model.named_parameters()}, str(path))


@torch.no_grad()
def load(model: nn.Module, path: Union[str, Path]) -> nn.Module:
    """Read parameters written by :func:`save`; names and shapes must match exactly."""
    tensors = load_file(str(path))
    params = dict(model.named_parameters())
    if set(tensors) != set(params):
        raise ValueError(f"path holds parameters {sorted(set(tensors) ^ set(params))} that do not "
                         f"match the model")
    for n, p in params.items():
        if tensors[n].shape != p.shape:
            raise ValueError(f"path: parameter {n} has shape {tuple(tensors[n].shape)}, "
                             f"model wants {tuple(p.shape)}")
        p.copy_(tensors[n])
    return model
