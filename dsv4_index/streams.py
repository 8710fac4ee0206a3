"""The CUDA stream a :class:`~dsv4_index.pipeline.MetadataPipeline` runs its device work on (``stream=``).

Without one (``stream=None``, the default) the pipeline uses the *current* stream at each call, as every torch
op does. With one, ``update()`` (its one host-to-device copy, and the apply of a staged step never built),
``build()`` (the launches, the CUDA-graph replay or capture) and ``warmup()`` run under
``torch.cuda.stream(stream)`` whatever stream is current: the metadata is then ordered on that stream. A
forward on another stream must wait for it (``forward_stream.wait_stream(stream)``), and the stream for the
forward before the next ``build()`` rewrites the buffers it reads (``stream.wait_stream(forward_stream)``).
``meta.topk_to_slots`` launches on the current stream of its caller (the forward's).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["check_stream", "on_stream"]


def check_stream(stream, device: torch.device) -> Optional[torch.cuda.Stream]:
    """``stream`` checked for a pipeline on ``device``: None, or a ``torch.cuda.Stream`` of that CUDA device.
    Raises ValueError naming ``stream`` otherwise."""
    if stream is None:
        return None
    if not isinstance(stream, torch.cuda.Stream):
        raise ValueError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if device.type != "cuda":
        raise ValueError(f"stream: a CUDA stream needs a CUDA pipeline, this one's device is {device}")
    index = torch.cuda.current_device() if device.index is None else device.index
    if stream.device.index != index:
        raise ValueError(f"stream is on {stream.device}, the pipeline on cuda:{index}")
    return stream


def on_stream(method):
    """A pipeline method run under ``torch.cuda.stream(self.stream)`` when the pipeline has one (else as is)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.stream is None:
            return method(self, *args, **kwargs)
        with torch.cuda.stream(self.stream):
            return method(self, *args, **kwargs)
    return run
