"""jaxclip: gradient clipping for JAX as optax transformations over pytrees."""

from jaxclip.adaptive import (
    AutoClipState,
    SkipLargeUpdatesState,
    ZClipState,
    adaptive_clip,
    auto_clip,
    skip_large_updates,
    zclip,
)
from jaxclip.clipping import (
    ClipByGlobalNormState,
    ClipByNormState,
    clip_by_global_norm,
    clip_by_norm,
    clip_by_value,
    clip_tree_by_global_norm,
    clip_tree_by_norm,
    clip_tree_by_value,
    global_norm,
)

__version__ = "0.1.0"

__all__ = [
    "AutoClipState",
    "SkipLargeUpdatesState",
    "ZClipState",
    "adaptive_clip",
    "auto_clip",
    "skip_large_updates",
    "zclip",
    "ClipByGlobalNormState",
    "ClipByNormState",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip_tree_by_global_norm",
    "clip_tree_by_norm",
    "clip_tree_by_value",
    "global_norm",
]
