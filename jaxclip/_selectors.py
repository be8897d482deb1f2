"""Selection helpers: ``need_clip`` rules by parameter name, path pattern or rank.

Each helper returns a :class:`Selector`, a rule ``(path, leaf) -> bool`` that composes
with ``&``, ``|`` and ``~`` and that every ``need_clip`` argument accepts. Paths are the
names users see (see ``_tree.flatten_with_paths``): ``l1/kernel`` for Flax NNX (not
``l1/kernel/value``), ``params/Dense_0/kernel`` for linen, ``layers/0/weight`` for Equinox.

A Selector is deliberately *not* callable: ``optax.inject_hyperparams`` takes every
callable argument for a schedule and calls it with the step count, so a plain function
``need_clip`` needs ``static_args=("need_clip",)`` there, while a Selector is passed
through untouched. Call :meth:`Selector.matches` to evaluate one by hand.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: Parameter names Flax gives biases and normalisation offsets/scales.
BIAS_AND_NORM_NAMES = ("bias", "scale")


@dataclasses.dataclass(frozen=True)
class _Pattern:
    """One name or path pattern of a helper, which must match some leaf of the tree."""

    shown: str  # as the user wrote it, e.g. "'bias'" or "re.compile('l[0-9]/w')"
    helper: str  # the helper it was given to, e.g. "exclude_names"
    test: Callable[[str], bool]  # path -> whether the pattern matches it


class Selector:
    """A ``need_clip`` rule: ``fn(path, leaf) -> bool``, composable with ``&``, ``|``, ``~``.

    Pass it as ``need_clip`` (or, wrapping a labelling function, as ``group``) to any
    jaxclip function or transformation. Unlike a plain function it also works inside
    ``optax.inject_hyperparams`` without ``static_args`` (it is not callable, so optax
    does not take it for a schedule). Wrap your own function to get the same:
    ``jaxclip.Selector(lambda path, leaf: "decoder" in path)``.

    A name or path pattern of :func:`by_name`, :func:`exclude_names`, :func:`by_path` or
    :func:`exclude_paths` (also inside a combination) that matches no leaf of the tree is a
    ``ValueError`` naming the pattern and some of the tree's paths, since a misspelt
    ``exclude_names("biases")`` would otherwise clip everything without a word; pass
    ``allow_unmatched=True`` to that helper where a pattern may match nothing by design
    (one rule for several models). A rule that selects no leaf is fine otherwise: it clips
    nothing, as Paddle does when no parameter has ``need_clip``.

    Args:
      fn: a function ``fn(path: str, leaf) -> bool`` (or ``-> label`` for ``group``);
        ``path`` is the leaf's ``/``-joined path as users name it.
      description: how the rule reads in ``repr`` (defaults to the function's name).

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> rule = jaxclip.min_rank(2) & ~jaxclip.by_name("embedding")
      >>> rule
      min_rank(2) & ~by_name('embedding')
      >>> rule.matches("dense/kernel", jnp.ones((3, 4))), rule.matches("dense/bias", jnp.ones(4))
      (True, False)
    """

    __slots__ = ("description", "fn", "patterns")

    def __init__(
        self,
        fn: Callable[[str, Any], Any],
        description: str | None = None,
        *,
        _patterns: Sequence[_Pattern] = (),
    ) -> None:
        if description is not None and not isinstance(description, str):
            raise TypeError(
                f"jaxclip.Selector: description={description!r} is a "
                f"{type(description).__name__}; pass a str (how the rule reads), or None."
            )
        patterns = tuple(_patterns)
        if isinstance(fn, Selector):
            patterns = patterns or fn.patterns
            fn, description = fn.fn, description or fn.description
        if not callable(fn):
            raise TypeError(
                f"jaxclip.Selector: fn={fn!r} is a {type(fn).__name__}, not a callable; pass a "
                "function fn(path, leaf) -> bool."
            )
        self.fn = fn
        self.description = description or getattr(fn, "__name__", repr(fn))
        #: The name and path patterns that must each match some leaf (see the class doc).
        self.patterns: tuple[_Pattern, ...] = patterns

    def matches(self, path: str, leaf: Any) -> Any:
        """The rule's value for the leaf at ``path``: a bool (a label for ``group``)."""
        return self.fn(path, leaf)

    def __and__(self, other: Selector | Callable[[str, Any], bool]) -> Selector:
        b = _as_selector(other)
        return Selector(
            lambda path, leaf: _bool(self, path, leaf) and _bool(b, path, leaf),
            f"{_wrap(self, '&')} & {_wrap(b, '&')}",
            _patterns=self.patterns + b.patterns,
        )

    def __or__(self, other: Selector | Callable[[str, Any], bool]) -> Selector:
        b = _as_selector(other)
        return Selector(
            lambda path, leaf: _bool(self, path, leaf) or _bool(b, path, leaf),
            f"{_wrap(self, '|')} | {_wrap(b, '|')}",
            _patterns=self.patterns + b.patterns,
        )

    __rand__ = __and__
    __ror__ = __or__

    def __invert__(self) -> Selector:
        return Selector(
            lambda path, leaf: not _bool(self, path, leaf),
            f"~{_wrap(self, '~')}",
            _patterns=self.patterns,
        )

    def __repr__(self) -> str:
        return self.description


def check_unmatched(
    rule: Selector, paths: Sequence[str], absent: Callable[[], Sequence[str]] = lambda: ()
) -> None:
    """A ValueError for the first name or path pattern of ``rule`` that matches none of
    ``paths`` (the tree's leaves) nor ``absent()`` (the paths of its None and
    ``optax.MaskedNode`` entries: a frozen or ``optax.masked``-out parameter is there, only
    without a gradient); a tree without leaves has nothing to check."""
    if not paths:
        return
    others: Sequence[str] | None = None  # absent(), read once and only if needed
    for pattern in rule.patterns:
        if any(pattern.test(p) for p in paths):
            continue
        others = absent() if others is None else others
        if any(pattern.test(p) for p in others):
            continue
        what = "name" if "name" in pattern.helper else "path pattern"
        shown = ", ".join(repr(p) for p in paths[:6]) + (", ..." if len(paths) > 6 else "")
        raise ValueError(
            f"jaxclip: need_clip={rule!r}: the {what} {pattern.shown} of "
            f"{pattern.helper}(...) matches no leaf of the tree, so it selects or excludes "
            f"nothing (the tree's {len(paths)} leaf paths: {shown}). Check its spelling "
            f"against these paths; where it may match nothing by design (one rule for several "
            f"models), pass {pattern.helper}(..., allow_unmatched=True)."
        )


def _as_selector(rule: Any) -> Selector:
    if isinstance(rule, Selector):
        return rule
    if callable(rule):
        return Selector(rule)
    raise TypeError(
        f"jaxclip: cannot combine a Selector with {rule!r} of type {type(rule).__name__}; "
        "combine Selectors or functions (path, leaf) -> bool."
    )


def _wrap(rule: Selector, op: str) -> str:
    """``rule``'s description, parenthesised where the operator would bind differently."""
    d = rule.description
    if (" | " in d and op in "&~") or (" & " in d and op == "~"):
        return f"({d})"
    return d


def _bool(rule: Selector, path: str, leaf: Any) -> bool:
    out = rule.matches(path, leaf)
    if not isinstance(out, (bool, np.bool_)):
        raise TypeError(
            f"jaxclip: the selector {rule!r} returned {out!r} of type {type(out).__name__} for "
            f"the leaf at {path!r}; it must return a Python bool."
        )
    return bool(out)


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _check_strings(values: tuple[Any, ...], fn: str, *, patterns: bool = False) -> None:
    """Names (str) or, with ``patterns``, globs (str) and compiled regular expressions."""
    what = "glob pattern (a str) or compiled regular expression" if patterns else "name (a str)"
    if not values:
        raise ValueError(f"jaxclip.{fn}: pass at least one {what}.")
    allowed = (str, re.Pattern) if patterns else (str,)
    for v in values:
        if not isinstance(v, allowed):
            example = f'{fn}("encoder/*")' if patterns else f'{fn}("bias")'
            raise TypeError(
                f"jaxclip.{fn}: {v!r} of type {type(v).__name__} is not a "
                f"{'' if patterns else 'parameter '}{what}; pass names as strings, e.g. "
                f"{example}."
            )


def _check_allow(allow_unmatched: Any, fn: str) -> bool:
    if not isinstance(allow_unmatched, (bool, np.bool_)):
        raise TypeError(
            f"jaxclip.{fn}: allow_unmatched={allow_unmatched!r} is a "
            f"{type(allow_unmatched).__name__}; pass allow_unmatched=True or False."
        )
    return bool(allow_unmatched)


def _shown(allow: bool) -> str:
    return ", allow_unmatched=True" if allow else ""


def _by_name(names: tuple[Any, ...], fn: str, allow_unmatched: Any) -> Selector:
    _check_strings(names, fn)
    allow = _check_allow(allow_unmatched, fn)
    wanted = frozenset(names)
    patterns = (
        ()
        if allow
        else tuple(_Pattern(repr(n), fn, lambda path, n=n: _name(path) == n) for n in names)
    )
    return Selector(
        lambda path, leaf: _name(path) in wanted,
        f"by_name({', '.join(map(repr, names))}{_shown(allow)})",
        _patterns=patterns,
    )


def by_name(*names: str, allow_unmatched: bool = False) -> Selector:
    """Selects the leaves whose parameter name (the last part of the path) is one of ``names``.

    Args:
      *names: parameter names, e.g. ``"bias"``, ``"scale"``, ``"embedding"``. Flax
        (linen and NNX) names them ``kernel``, ``bias``, ``scale``, ``embedding``;
        Equinox ``weight`` and ``bias``; Haiku ``w``, ``b``, ``scale``, ``offset``.
      allow_unmatched: allow a name that no leaf of the tree has; by default that is a
        ``ValueError`` naming it (a misspelt name would select nothing without a word).

    Returns:
      A :class:`Selector`: True for ``.../bias`` when ``"bias"`` is given.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> grads = {"dense": {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.full(2, 100.0)}}
      >>> jaxclip.global_norm(grads, need_clip=~jaxclip.by_name("bias"))  # the kernel only
      Array(4., dtype=float32)
    """
    return _by_name(names, "by_name", allow_unmatched)


def exclude_names(*names: str, allow_unmatched: bool = False) -> Selector:
    """Selects every leaf except those whose parameter name is one of ``names``.

    The same as ``~by_name(*names)``: the counterpart of Paddle's
    ``ParamAttr(need_clip=False)`` on those parameters.

    Args:
      *names: parameter names to leave out, e.g. ``"bias"``.
      allow_unmatched: allow a name that no leaf of the tree has; by default that is a
        ``ValueError`` naming it: ``exclude_names("biases")`` on a model whose biases are
        ``bias`` would otherwise clip the biases too.

    Returns:
      A :class:`Selector`.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> grads = {"dense": {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.full(2, 100.0)}}
      >>> jaxclip.global_norm(grads, need_clip=jaxclip.exclude_names("bias"))
      Array(4., dtype=float32)
    """
    return ~_by_name(names, "exclude_names", allow_unmatched)


def _by_path(patterns: tuple[Any, ...], fn: str, allow_unmatched: Any) -> Selector:
    _check_strings(patterns, fn, patterns=True)
    allow = _check_allow(allow_unmatched, fn)
    compiled = [
        p if isinstance(p, re.Pattern) else re.compile(fnmatch.translate(p)) for p in patterns
    ]
    shown = [repr(p) if isinstance(p, str) else f"re.compile({p.pattern!r})" for p in patterns]
    found = (
        ()
        if allow
        else tuple(
            _Pattern(s, fn, lambda path, c=c: c.fullmatch(path) is not None)
            for s, c in zip(shown, compiled)
        )
    )
    return Selector(
        lambda path, leaf: any(c.fullmatch(path) for c in compiled),
        f"by_path({', '.join(shown)}{_shown(allow)})",
        _patterns=found,
    )


def by_path(*patterns: str | re.Pattern[str], allow_unmatched: bool = False) -> Selector:
    """Selects the leaves whose ``/``-joined path matches one of ``patterns``.

    Args:
      *patterns: shell-style globs matched against the whole path (``fnmatch``: ``*``
        also crosses ``/``, so ``"encoder/*"`` is everything under ``encoder`` and
        ``"*/bias"`` every bias but a top-level one), or compiled regular expressions
        (``re.compile(...)``), which must match the whole path (``fullmatch``).
      allow_unmatched: allow a pattern that matches no leaf of the tree; by default that is
        a ``ValueError`` naming it and some of the tree's paths.

    Returns:
      A :class:`Selector`.

    Example:
      >>> import re, jax.numpy as jnp, jaxclip
      >>> rule = jaxclip.by_path("emb/*", re.compile(r"layers/\\d+/bias"))
      >>> rule.matches("emb/weight", None), rule.matches("layers/3/bias", None)
      (True, True)
      >>> rule.matches("layers/3/weight", None)
      False
    """
    return _by_path(patterns, "by_path", allow_unmatched)


def exclude_paths(*patterns: str | re.Pattern[str], allow_unmatched: bool = False) -> Selector:
    """Selects every leaf except those whose path matches one of ``patterns``.

    The same as ``~by_path(*patterns)`` (see :func:`by_path` for the patterns).

    Args:
      *patterns: globs or compiled regular expressions matched against the whole path.
      allow_unmatched: allow a pattern that matches no leaf of the tree; by default that is
        a ``ValueError`` naming it (``exclude_paths("l2/*")`` on a model without ``l2``
        would otherwise clip everything).

    Returns:
      A :class:`Selector`.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> grads = {"emb": {"weight": jnp.full((2, 2), 9.0)}, "out": {"weight": jnp.ones(4)}}
      >>> jaxclip.global_norm(grads, need_clip=jaxclip.exclude_paths("emb/*"))
      Array(2., dtype=float32)
    """
    return ~_by_path(patterns, "exclude_paths", allow_unmatched)


def min_rank(rank: int = 2) -> Selector:
    """Selects the leaves with at least ``rank`` dimensions, as weight-decay masks do.

    ``min_rank(2)`` keeps matrices and up (dense and convolution kernels, embeddings)
    and leaves out scalars and vectors: biases and normalisation scales in every
    framework (Equinox's ``LayerNorm.weight`` too, which no name tells apart).

    Args:
      rank: the smallest number of dimensions (``leaf.ndim``) a selected leaf has.

    Returns:
      A :class:`Selector`.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> grads = {"w": jnp.full((2, 2), 2.0), "b": jnp.full(2, 100.0)}
      >>> jaxclip.global_norm(grads, need_clip=jaxclip.min_rank(2))
      Array(4., dtype=float32)
    """
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 0:
        raise ValueError(
            f"jaxclip.min_rank: rank={rank!r} must be a Python int >= 0, e.g. 2 for matrices "
            "and up."
        )
    n = int(rank)
    return Selector(lambda path, leaf: int(np.ndim(leaf)) >= n, f"min_rank({n})")


def exclude_biases_and_norms() -> Selector:
    """Leaves out biases and normalisation parameters: the usual no-clip (and no-decay) set.

    A leaf is left out when its name is ``bias`` or ``scale`` (Flax's biases, also the 2-D
    ones of attention heads, and its LayerNorm/BatchNorm/RMSNorm parameters) or when it
    has fewer than two dimensions (every bias and normalisation weight in Equinox and
    Haiku, e.g. Equinox's ``LayerNorm.weight``). Kernels, convolution filters and
    embeddings stay. The same as
    ``exclude_names("bias", "scale", allow_unmatched=True) & min_rank(2)``: a model without
    either name is fine.

    Returns:
      A :class:`Selector`.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> grads = {"l1": {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.ones(2)},
      ...          "ln": {"scale": jnp.ones(2), "bias": jnp.ones(2)}}
      >>> jaxclip.global_norm(grads, need_clip=jaxclip.exclude_biases_and_norms())
      Array(4., dtype=float32)
    """
    rule = exclude_names(*BIAS_AND_NORM_NAMES, allow_unmatched=True) & min_rank(2)
    rule.description = "exclude_biases_and_norms()"
    return rule
