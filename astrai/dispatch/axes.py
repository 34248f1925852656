"""The axis vocabulary: every axis a spec may test, its type and its allowed values.

This is the one place that declares what a call context can be asked. The grammar
type-checks expressions against it, ``Spec`` reads values through it, and
``explain`` formats values with it. A family's table may declare extra axes
(name + type) that exist for that family only.
"""

from __future__ import annotations

__all__ = [
    "AXES",
    "DTYPES",
    "FWD_MODES",
    "PREDICATES",
    "Axis",
    "AxisKind",
    "Vocabulary",
    "dtype_name",
    "format_context",
    "format_value",
]

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

AxisKind = Literal["bool", "int", "enum", "dtype"]

#: torch's dtype names (aliases such as ``half`` included), mapped to the dtype.
DTYPES: Mapping[str, torch.dtype] = {
    name: value
    for name in sorted(dir(torch))
    if isinstance(value := getattr(torch, name), torch.dtype)
}

#: The dtypes error messages list (any name in ``DTYPES`` is accepted).
COMMON_DTYPES: tuple[str, ...] = (
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
    "int8", "int16", "int32", "int64", "uint8", "bool", "complex64", "complex128",
)

#: The forward modes a call can be in; ``None`` is training / a plain forward.
FWD_MODES: tuple[str, ...] = ("prefill", "decode")


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a dtype: ``torch.float16`` -> ``float16``."""
    return str(dtype).removeprefix("torch.")


def format_context(ctx: Any) -> str:
    """A call's axes as ``explain`` writes them: ``fwd=none dtype=int64 ndim=4 ...``."""
    parts = [f"{name}={format_value(axis.getter(ctx))}" for name, axis in AXES.items()]
    parts += [f"{k}={format_value(v)}" for k, v in sorted(ctx.extra.items())]
    return " ".join(parts)


def format_value(value: Any) -> str:
    """A value as the grammar writes it (``none``, ``true``, ``bfloat16``, ``64``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return str(value)


@dataclass(frozen=True)
class Axis:
    """One axis of a call context.

    ``kind`` is ``bool`` (stands alone in an expression), ``int`` (ordered),
    ``enum`` (one of ``values``) or ``dtype`` (one of torch's dtype names).
    ``nullable`` axes may hold ``None`` (written ``none``).
    """

    name: str
    kind: AxisKind
    values: tuple[str, ...] = ()
    nullable: bool = False
    description: str = ""
    core: bool = True
    getter: Callable[[Any], Any] = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.getter is None:
            if self.core:
                get: Callable[[Any], Any] = operator.attrgetter(self.name)
            else:
                name = self.name

                def get(ctx: Any) -> Any:
                    return ctx.extra.get(name)

            object.__setattr__(self, "getter", get)

    @property
    def ordered(self) -> bool:
        """Whether ``<``, ``<=``, ``>``, ``>=`` make sense on this axis."""
        return self.kind == "int"

    def value_names(self) -> list[str]:
        """The names a value of this axis may be written as (for error messages)."""
        if self.kind == "bool":
            names = ["true", "false"]
        elif self.kind == "dtype":
            names = [n for n in COMMON_DTYPES if n in DTYPES]
        elif self.kind == "enum":
            names = list(self.values)
        else:
            names = []
        if self.nullable:
            names.append("none")
        return names


AXES: Mapping[str, Axis] = {
    a.name: a
    for a in (
        Axis("fwd", "enum", FWD_MODES, nullable=True,
             description="forward mode: none (training / plain forward), prefill or decode"),
        Axis("dtype", "dtype", nullable=True, description="dtype of the main input"),
        Axis("device_cuda", "bool", description="the call's tensors are on a CUDA device"),
        Axis("ndim", "int", nullable=True, description="rank of the main input"),
        Axis("head_dim", "int", nullable=True, description="attention head size"),
        Axis("has_cache", "bool", description="a KV cache is passed"),
        Axis("has_mask", "bool", description="an attention mask is passed"),
        Axis("grad_enabled", "bool", description="autograd is recording"),
    )
}

#: Named predicates: name -> (expression it abbreviates, axis it reads).
PREDICATES: Mapping[str, tuple[str, str]] = {
    "inference": ("fwd != none", "fwd"),
    "training": ("fwd == none", "fwd"),
    "no_grad": ("not grad_enabled", "grad_enabled"),
    "mask_free": ("not has_mask", "has_mask"),
    "cuda_device": ("device_cuda", "device_cuda"),
}

#: Words with a fixed meaning that cannot name an axis or predicate.
KEYWORDS = frozenset({"and", "or", "not", "in", "always", "never", "none", "true", "false"})


@dataclass(frozen=True)
class Vocabulary:
    """The axes and predicates an expression may use: the core set plus a family's extras."""

    axes: Mapping[str, Axis] = field(default_factory=lambda: AXES)
    predicates: Mapping[str, tuple[str, str]] = field(default_factory=lambda: PREDICATES)

    def with_extras(self, extras: Mapping[str, Axis]) -> Vocabulary:
        """This vocabulary plus a family's extra axes."""
        merged = dict(self.axes)
        merged.update(extras)
        return Vocabulary(merged, self.predicates)

    def names(self) -> list[str]:
        """Every name that may start an atom (axes and predicates)."""
        return sorted([*self.axes, *self.predicates])


CORE_VOCABULARY = Vocabulary()
