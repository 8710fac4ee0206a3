"""A small DeepSeek-V4 attention (dense and paged) used to prove the metadata correct."""

from .attention import DSV4Attention, LayerCache, PagedCaches
from .config import DSV4Config, load_config
from .weights import init_weights, load, save

__all__ = ["DSV4Config", "load_config", "DSV4Attention", "PagedCaches", "LayerCache",
           "init_weights", "save", "load"]
