"""jaxclip: gradient clipping for JAX as optax transformations over pytrees.

The public names, each declared here once (``name as name`` re-exports them).
"""

from jaxclip._errors import NonFiniteNormError as NonFiniteNormError
from jaxclip._selectors import Selector as Selector
from jaxclip._selectors import by_name as by_name
from jaxclip._selectors import by_path as by_path
from jaxclip._selectors import exclude_biases_and_norms as exclude_biases_and_norms
from jaxclip._selectors import exclude_names as exclude_names
from jaxclip._selectors import exclude_paths as exclude_paths
from jaxclip._selectors import min_rank as min_rank
from jaxclip._stats import clip_stats as clip_stats
from jaxclip.adaptive import AutoClipState as AutoClipState
from jaxclip.adaptive import HistoryClipState as HistoryClipState
from jaxclip.adaptive import SkipLargeUpdatesState as SkipLargeUpdatesState
from jaxclip.adaptive import ZClipState as ZClipState
from jaxclip.adaptive import adaptive_clip as adaptive_clip
from jaxclip.adaptive import auto_clip as auto_clip
from jaxclip.adaptive import clip_tree_adaptive as clip_tree_adaptive
from jaxclip.adaptive import quantile_clip as quantile_clip
from jaxclip.adaptive import skip_large_updates as skip_large_updates
from jaxclip.adaptive import standard_clip as standard_clip
from jaxclip.adaptive import zclip as zclip
from jaxclip.clipping import ClipByGlobalNormState as ClipByGlobalNormState
from jaxclip.clipping import ClipByNormState as ClipByNormState
from jaxclip.clipping import clip_by_global_norm as clip_by_global_norm
from jaxclip.clipping import clip_by_norm as clip_by_norm
from jaxclip.clipping import clip_by_value as clip_by_value
from jaxclip.clipping import clip_tree_by_global_norm as clip_tree_by_global_norm
from jaxclip.clipping import clip_tree_by_norm as clip_tree_by_norm
from jaxclip.clipping import clip_tree_by_value as clip_tree_by_value
from jaxclip.clipping import global_norm as global_norm
from jaxclip.dp import AdaptiveClipPerExampleState as AdaptiveClipPerExampleState
from jaxclip.dp import ClippedGradAux as ClippedGradAux
from jaxclip.dp import adaptive_clip_noise_multiplier as adaptive_clip_noise_multiplier
from jaxclip.dp import adaptive_clip_per_example as adaptive_clip_per_example
from jaxclip.dp import clipped_grad as clipped_grad
from jaxclip.per_example import ClipPerExampleState as ClipPerExampleState
from jaxclip.per_example import clip_per_example as clip_per_example
from jaxclip.per_example import clip_tree_per_example as clip_tree_per_example

__version__ = "0.1.0"

__all__ = [
    "AdaptiveClipPerExampleState",
    "AutoClipState",
    "ClipByGlobalNormState",
    "ClipByNormState",
    "ClipPerExampleState",
    "ClippedGradAux",
    "HistoryClipState",
    "NonFiniteNormError",
    "Selector",
    "SkipLargeUpdatesState",
    "ZClipState",
    "adaptive_clip",
    "adaptive_clip_noise_multiplier",
    "adaptive_clip_per_example",
    "auto_clip",
    "by_name",
    "by_path",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip_per_example",
    "clip_stats",
    "clip_tree_adaptive",
    "clip_tree_by_global_norm",
    "clip_tree_by_norm",
    "clip_tree_by_value",
    "clip_tree_per_example",
    "clipped_grad",
    "exclude_biases_and_norms",
    "exclude_names",
    "exclude_paths",
    "global_norm",
    "min_rank",
    "quantile_clip",
    "skip_large_updates",
    "standard_clip",
    "zclip",
]
