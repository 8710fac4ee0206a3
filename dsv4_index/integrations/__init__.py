"""Adapters to serving engines. Each module imports its engine nowhere at import time (duck-typed objects):
:mod:`.vllm` (vLLM's model runner: ``SchedulerOutput`` + ``InputBatch`` order -> per-layer metadata)."""
