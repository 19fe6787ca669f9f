"""The layer-wise engine: chains of known layers, by hand-written per-layer rules
(:mod:`.rules`), orchestrated by :mod:`.engine`."""

from .engine import LayerwiseEngine

__all__ = ["LayerwiseEngine"]
