"""The registry of jaxclip's modes: one entry per transformation.

Each :class:`Mode` names the factory, the hyperparameter that
``optax.inject_hyperparams`` schedules in the tests and examples, the state type, the
state fields that :func:`jaxclip.clip_stats` reports, and an example configuration
built from scalars. The tests run every mode of :data:`MODES` through the same checks,
``clip_stats`` reports the fields named here, and the docs list the modes from it:
a new mode is one entry here and one name in ``jaxclip/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optax

from jaxclip import adaptive, clipping, dp, per_example


class Mode(NamedTuple):
    """One of jaxclip's transformations.

    Attributes:
      factory: the public function that builds it.
      scheduled: the hyperparameter a schedule may drive (``inject_hyperparams``).
      state: the state's type (``optax.EmptyState`` for stateless modes).
      logged: the state's fields that :func:`jaxclip.clip_stats` reports.
      example: keyword arguments of a small working configuration (with ``scheduled``).
      needs_params: whether ``update`` reads ``params``.
      batched: whether ``update`` takes per-example gradients (a leading batch axis).
    """

    factory: Callable[..., optax.GradientTransformation]
    scheduled: str
    state: type
    logged: tuple[str, ...]
    example: dict[str, Any]
    needs_params: bool = False
    batched: bool = False

    @property
    def name(self) -> str:
        """The factory's public name, ``jaxclip.<name>``."""
        return self.factory.__name__

    def build(self, **overrides: Any) -> optax.GradientTransformation:
        """The example configuration, with ``overrides``."""
        return self.factory(**{**self.example, **overrides})


#: Every transformation of jaxclip, in the order of the docs.
MODES: tuple[Mode, ...] = (
    Mode(clipping.clip_by_value, "max", optax.EmptyState, (), {"max": 1.0}),
    Mode(
        clipping.clip_by_norm,
        "clip_norm",
        clipping.ClipByNormState,
        ("norms",),
        {"clip_norm": 1.0},
    ),
    Mode(
        clipping.clip_by_global_norm,
        "clip_norm",
        clipping.ClipByGlobalNormState,
        ("global_norm",),
        {"clip_norm": 1.0},
    ),
    Mode(
        adaptive.adaptive_clip,
        "clipping",
        optax.EmptyState,
        (),
        {"clipping": 0.1},
        needs_params=True,
    ),
    Mode(
        adaptive.auto_clip,
        "percentile",
        adaptive.AutoClipState,
        ("global_norm", "threshold"),
        {"percentile": 10.0, "window": 8},
    ),
    Mode(
        adaptive.quantile_clip,
        "quantile",
        adaptive.HistoryClipState,
        ("norm", "threshold"),
        {"quantile": 0.5, "history_length": 8},
    ),
    Mode(
        adaptive.standard_clip,
        "deviations",
        adaptive.HistoryClipState,
        ("norm", "threshold"),
        {"deviations": 2.0, "history_length": 8},
    ),
    Mode(
        adaptive.zclip,
        "z_thresh",
        adaptive.ZClipState,
        ("global_norm", "threshold"),
        {"z_thresh": 2.5, "warmup_steps": 3},
    ),
    Mode(
        adaptive.skip_large_updates,
        "threshold",
        adaptive.SkipLargeUpdatesState,
        ("global_norm", "skipped"),
        {"inner": optax.identity(), "threshold": 10.0},
    ),
    Mode(
        per_example.clip_per_example,
        "clip_norm",
        per_example.ClipPerExampleState,
        ("norms", "clipped_fraction"),
        {"clip_norm": 1.0},
        batched=True,
    ),
    Mode(
        dp.adaptive_clip_per_example,
        "target_unclipped_quantile",
        dp.AdaptiveClipPerExampleState,
        ("clip_norm", "unclipped_fraction"),
        {"initial_clip_norm": 1.0},
        batched=True,
    ),
)

#: The state fields :func:`jaxclip.clip_stats` reports, over every mode.
LOGGED_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(f for m in MODES for f in m.logged))


def logged_fields(state: Any) -> tuple[str, ...]:
    """The fields of ``state`` (a jaxclip state) that ``clip_stats`` reports, in order."""
    for m in MODES:
        if type(state) is m.state:
            return m.logged
    return tuple(f for f in LOGGED_FIELDS if f in getattr(state, "_fields", ()))


def mode(name: str) -> Mode:
    """The registry entry of ``jaxclip.<name>``."""
    for m in MODES:
        if m.name == name:
            return m
    raise KeyError(f"jaxclip has no mode {name!r}; modes: {[m.name for m in MODES]}")
