"""The axes of a call: the ONE list of what a call context can be asked.

Each core axis is declared once, as a field of ``CallContext`` carrying its
``Axis`` (type, allowed values, default, command-line flag). Everything else is
derived from that list: ``AXES``, the grammar's vocabulary, ``CallContext``'s
signature (the decision-cache key), explain's fields and text, the CLI's flags and
the distributed fingerprint. A family's table may declare extra axes (name +
type) that exist for that family only; their values travel in ``extra``.

Adding an axis: one field of ``CallContext``, plus the facades' context builders
that fill it.
"""

from __future__ import annotations

__all__ = [
    "AXES",
    "BASE_AXES",
    "CORE_AXES",
    "DEVICE_TYPES",
    "DTYPES",
    "EMPTY",
    "EXPRESSION_AXES",
    "FEATURES_OFF",
    "FEATURE_AXES",
    "FWD_MODES",
    "LAZY_AXES",
    "MACHINE_AXES",
    "NO_FEATURES",
    "PREDICATES",
    "ROTARY_LAYOUTS",
    "TRACED_AXIS",
    "Axis",
    "AxisKind",
    "CallContext",
    "Vocabulary",
    "asked_features",
    "call_key",
    "context_fields",
    "context_from_fields",
    "dtype_name",
    "format_context",
    "format_value",
    "read_features",
    "unremarkable",
]

import dataclasses
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from astrai.dispatch.hardware import (
    CPU_VENDORS,
    GPU_VENDORS,
    ISA_LEVELS,
    IsaLevel,
    isa_level,
    machine_facts,
)
from astrai.suggestions import did_you_mean

AxisKind = Literal["bool", "int", "enum", "dtype", "level"]

#: torch's dtype names (aliases such as ``half`` included), mapped to the dtype.
DTYPES: Mapping[str, torch.dtype] = dict(
    sorted((name, value) for name, value in vars(torch).items()
           if isinstance(value, torch.dtype))
)

#: The dtypes error messages list (any name in ``DTYPES`` is accepted).
COMMON_DTYPES: tuple[str, ...] = (
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
    "int8", "int16", "int32", "int64", "uint8", "bool", "complex64", "complex128",
)

#: The forward modes a call can be in; ``None`` is training / a plain forward.
FWD_MODES: tuple[str, ...] = ("prefill", "decode")
#: The ``layout`` axis's values: adjacent pairs (the default) and transformers' halves.
ROTARY_LAYOUTS: tuple[str, ...] = ("pairs", "half")


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a dtype: ``torch.float16`` -> ``float16``."""
    return str(dtype).removeprefix("torch.")


def format_context(ctx: Any) -> str:
    """A call's axes as ``explain`` writes them: ``fwd=none dtype=int64 ndim=4 ...`` (a
    lazy axis the call does not fill, or a feature it does not ask for, is left out)."""
    parts = [f"{name}={format_value(value)}" for name, axis in AXES.items()
             if not unremarkable(name, value := axis.getter(ctx))]
    parts += [f"{k}={format_value(v)}" for k, v in sorted(ctx.extra.items())]
    return " ".join(parts)


def unremarkable(name: str, value: Any) -> bool:
    """Whether explain's text leaves ``name=value`` out: a lazy axis the call does not
    fill, or a feature the call does not ask for."""
    axis = AXES.get(name)
    return axis is not None and (axis.lazy or axis.feature) and value == axis.default


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
    ``enum`` (one of ``values``), ``level`` (one of ``values``, ordered as instruction-set
    levels are: ``astrai.dispatch.hardware.IsaLevel``) or ``dtype`` (one of torch's dtype
    names).
    ``nullable`` axes may hold ``None`` (written ``none``). A core axis also has its
    ``default`` and the command-line ``flag`` that sets it (a bool flag sets the value
    opposite to the default; an int flag takes a value of at least ``minimum``).
    A ``lazy`` axis (a shape or hardware axis) is read off a call only when some loaded
    table compares it, and an ordered one enters the decision-cache key as the interval
    between the tables' cut points its value falls in (``astrai.dispatch.keying``).
    A ``feature`` axis is something a call asks for beyond plain computation (a custom
    scale, soft-capping, ...): it is off (its default) unless asked for, and a row serves
    a call that asks for it only when the row declares it (``features:``).
    A ``machine`` axis is a fact about the machine (``astrai.dispatch.hardware``), the
    same for every call of a process: it is no field of a call and never enters a
    decision key; a context may state another machine's value in ``extra``.
    """

    name: str
    kind: AxisKind
    values: tuple[str, ...] = ()
    nullable: bool = False
    description: str = ""
    core: bool = True
    getter: Callable[[Any], Any] = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    default: Any = None
    flag: str = ""
    minimum: int = 0
    lazy: bool = False
    feature: bool = False
    machine: bool = False

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
        return self.kind in ("int", "level")

    def value_names(self) -> list[str]:
        """The names a value of this axis may be written as (for error messages)."""
        if self.kind == "bool":
            names = ["true", "false"]
        elif self.kind == "dtype":
            names = [n for n in COMMON_DTYPES if n in DTYPES]
        elif self.kind in ("enum", "level"):
            names = list(self.values)
        else:
            names = []
        if self.nullable:
            names.append("none")
        return names

    def parse(self, text: str) -> Any:
        """A value of this axis from its written form (``none``, ``true``, ``bfloat16``,
        ``64``); ``ValueError`` saying what was expected."""
        if text == "none" and self.nullable:
            return None
        if self.kind == "bool" and text in ("true", "false"):
            return text == "true"
        if self.kind == "int":
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"expected an integer, got {text!r}") from None
            if value < self.minimum:
                raise ValueError(f"expected an integer >= {self.minimum}, got {value}")
            return value
        if self.kind == "dtype" and text in DTYPES:
            return DTYPES[text]
        if self.kind == "enum" and text in self.values:
            return text
        if self.kind == "level" and text in self.values:
            return isa_level(text)
        return self._refuse(text)

    def _refuse(self, text: str) -> Any:
        if self.kind == "dtype":
            raise ValueError(f"unknown dtype {text!r}{did_you_mean(text, DTYPES)}")
        raise ValueError(f"expected {' or '.join(self.value_names())}, got {text!r}")


def _axis(kind: AxisKind, default: Any, description: str, *, values: tuple[str, ...] = (),
          nullable: bool = False, flag: str = "", minimum: int = 0, lazy: bool = False,
          feature: bool = False) -> Any:
    """A ``CallContext`` field that is a core axis (its ``Axis`` rides in the metadata)."""
    spec = {"kind": kind, "default": default, "description": description, "values": values,
            "nullable": nullable, "flag": flag, "minimum": minimum, "lazy": lazy,
            "feature": feature}
    return field(default=default, metadata={"axis": spec})


def _size(description: str, flag: str, minimum: int = 0) -> Any:
    """A lazy int axis: a size read off the call's shapes (``none`` when not described)."""
    return _axis("int", None, description, nullable=True, flag=flag, minimum=minimum, lazy=True)


def _device_types() -> tuple[str, ...]:
    """The device types a tensor may report (``Tensor.device.type``)."""
    known = ["cpu", "cuda", "mps", "xpu", "hpu", "mtia", "maia", "xla", "lazy", "meta", "ipu",
             "ve", "vulkan", "privateuseone"]
    renamed = torch._C._get_privateuse1_backend_name()
    if renamed not in known:
        known.append(renamed)
    return tuple(known)


#: The device types the ``device`` axis may name.
DEVICE_TYPES = _device_types()


EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class CallContext:
    """What a spec may know about a call: the family and one value per axis.

    ``fwd`` is ``None`` for training / a plain forward, else ``"prefill"`` or
    ``"decode"``. ``extra`` carries the values of axes a family declares in its
    table. ``raw`` / ``raw_kwargs`` are the original call, so an unregistered
    implementation object can be probed through its own ``supports_call``;
    they take no part in equality or hashing.
    """

    family: str
    fwd: str | None = _axis("enum", None, "forward mode: none (training / plain forward), "
                            "prefill or decode", values=FWD_MODES, nullable=True, flag="--fwd")
    dtype: torch.dtype | None = _axis("dtype", None, "dtype of the main input", nullable=True,
                                      flag="--dtype")
    device_cuda: bool = _axis("bool", False, "the call's tensors are on a CUDA device",
                              flag="--cuda")
    ndim: int | None = _axis("int", None, "number of dimensions of the main input",
                             nullable=True, flag="--ndim")
    head_dim: int | None = _axis("int", None, "head size (the last dim of a head)", nullable=True,
                                 flag="--head-dim", minimum=1)
    has_cache: bool = _axis("bool", False, "a KV cache is passed", flag="--cache")
    has_mask: bool = _axis("bool", False, "an attention mask is passed", flag="--mask")
    grad_enabled: bool = _axis("bool", True, "autograd is recording", flag="--no-grad")
    # The lazy axes: shape and hardware, read only when a loaded table compares them.
    device: str | None = _axis("enum", None, "device type of the call's tensors (cpu, cuda, "
                               "mps, xpu, ...)", values=DEVICE_TYPES, nullable=True,
                               flag="--device", lazy=True)
    sm: int | None = _size("CUDA compute capability as major*10+minor (90 for Hopper); "
                           "none off CUDA", "--sm")
    batch: int | None = _size("sequences in the call", "--batch")
    q_len: int | None = _size("query tokens per sequence (packed/paged: the longest)", "--q-len")
    kv_len: int | None = _size("key tokens per sequence (the longest)", "--kv-len")
    heads: int | None = _size("query heads", "--heads", 1)
    kv_heads: int | None = _size("key/value heads (== heads: MHA, fewer: GQA)",
                                 "--kv-heads", 1)
    tokens: int | None = _size("rows of the input (product of the leading "
                               "dimensions)", "--tokens")
    in_features: int | None = _size("input features", "--in-features")
    out_features: int | None = _size("output features", "--out-features")
    # The features a call may ask for: off unless asked; served only by rows declaring them.
    scale: bool = _axis("bool", False, "a softmax scale other than "
                        "head_dim ** -0.5", flag="--scale", feature=True)
    softcap: bool = _axis("bool", False, "logits soft-capped, cap * tanh(s / cap)",
                          flag="--softcap", feature=True)
    dropout: bool = _axis("bool", False, "dropout on the probabilities (p > 0)",
                          flag="--dropout", feature=True)
    window: int | None = _axis("int", None, "sliding window, each query sees its "
                               "last window keys (itself included)", nullable=True,
                               flag="--window", minimum=1, feature=True)
    sinks: bool = _axis("bool", False, "a learned sink logit per head joins the "
                        "softmax", flag="--sinks", feature=True)
    return_weights: bool = _axis("bool", False, "the probabilities are returned "
                                 "with the output", flag="--return-weights", feature=True)
    layout: str = _axis("enum", "pairs", "which elements turn together: adjacent "
                        "pairs (2i, 2i+1), or the halves (i, i + head_dim/2) of "
                        "transformers' rotary", values=ROTARY_LAYOUTS,
                        flag="--layout", feature=True)
    weight_offset: bool = _axis("bool", False, "the weight is applied as "
                                "offset + weight (Gemma: 1 + weight)", flag="--weight-offset",
                                feature=True)
    cast_before_weight: bool = _axis("bool", False, "normalised in float32, cast "
                                     "back to the input's dtype, then scaled by the weight "
                                     "(LlamaRMSNorm)", flag="--cast-before-weight",
                                     feature=True)
    extra: Mapping[str, Any] = field(default_factory=lambda: EMPTY, hash=False)
    raw: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    raw_kwargs: Mapping[str, Any] = field(default_factory=lambda: EMPTY, compare=False, repr=False)
    # What ``resolve`` left on this object (``astrai.dispatch.resolution``): none here.
    # Annotated for type checkers only, so that it is no dataclass (pseudo-)field.
    if TYPE_CHECKING:
        _resolved: ClassVar[tuple[Any, ...] | None]
    _resolved = None

    def __getstate__(self) -> dict[str, Any]:
        """The fields, without what ``resolve`` left on this object (see its docstring):
        a copy or an unpickled context is a new call context."""
        return {k: v for k, v in self.__dict__.items() if k != "_resolved"}

    def evolve(self, **changes: Any) -> CallContext:
        """A copy with the given fields changed."""
        return dataclasses.replace(self, **changes)

    def signature(self) -> tuple[Any, ...]:
        """The hashable identity of the call: ``(family, *base axis values, extra)``, then
        the lazy axes' values as one tuple when the call fills any; ``raw`` excluded;
        computed once."""
        fields = self.__dict__
        got = fields.get("_signature")
        if got is not None:
            return got  # type: ignore[no-any-return]
        extra = tuple(sorted(self.extra.items())) if self.extra else ()
        lazy = _read_lazy(self)
        got = _read_family_base(self) + ((extra,) if lazy == _UNFILLED else (extra, lazy))
        fields["_signature"] = got  # (frozen: written past __setattr__)
        return got

    @classmethod
    def of(cls, family: str, names: tuple[str, ...], values: tuple[Any, ...],
           raw: tuple[Any, ...] = (), raw_kwargs: Mapping[str, Any] = EMPTY) -> CallContext:
        """The context with these axis values (core axes by name, the rest in ``extra``)."""
        core: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for name, value in zip(names, values, strict=True):
            (core if name in AXES else extra)[name] = value
        return cls(family, **core, extra=extra or EMPTY, raw=raw, raw_kwargs=raw_kwargs)

    def named_values(self) -> tuple[tuple[str, ...], tuple[Any, ...]]:
        """Every axis of the call, core then extra: ``(names, values)``."""
        keys = sorted(self.extra)
        # getattr, not the attrgetter: this runs in code torch.compile traces (ops.call).
        return ((*CORE_AXES, *keys),
                (*(getattr(self, n) for n in CORE_AXES), *(self.extra[k] for k in keys)))


#: The core axes, in declaration order: the one list everything else derives from.
AXES: Mapping[str, Axis] = MappingProxyType({
    f.name: Axis(f.name, **f.metadata["axis"])
    for f in dataclasses.fields(CallContext) if "axis" in f.metadata
})
CORE_AXES: tuple[str, ...] = tuple(AXES)
#: The lazy axes (see ``Axis.lazy``), in declaration order.
LAZY_AXES: tuple[str, ...] = tuple(name for name, axis in AXES.items() if axis.lazy)
#: The axes that are not lazy, in declaration order.
BASE_AXES: tuple[str, ...] = tuple(name for name in CORE_AXES if name not in LAZY_AXES)
_read_family_base = operator.attrgetter("family", *BASE_AXES)
_read_lazy = operator.attrgetter(*LAZY_AXES)
_UNFILLED = (None,) * len(LAZY_AXES)
#: The feature axes (see ``Axis.feature``), in declaration order.
FEATURE_AXES: tuple[str, ...] = tuple(name for name, axis in AXES.items() if axis.feature)
#: A call's feature axis values, in that order (one C call: the hot walk's first check).
read_features = operator.attrgetter(*FEATURE_AXES)
#: The feature axes' defaults: what ``read_features`` gives for a call asking for none.
FEATURES_OFF = tuple(AXES[name].default for name in FEATURE_AXES)
NO_FEATURES: frozenset[str] = frozenset()


def asked_features(ctx: CallContext) -> frozenset[str]:
    """The features ``ctx`` asks for (its feature axes not at their default)."""
    values = read_features(ctx)
    if values == FEATURES_OFF:
        return NO_FEATURES
    return frozenset(name for name, value, off in zip(FEATURE_AXES, values, FEATURES_OFF,
                                                       strict=True) if value != off)
_read_core = operator.attrgetter(*CORE_AXES)


def _machine_getter(name: str, level: bool) -> Callable[[Any], Any]:
    """A machine axis's reader: the value a context states for another machine (its
    ``extra``), else this machine's (read once per process)."""
    def get(ctx: Any) -> Any:
        extra = ctx.extra
        if name in extra:
            value = extra[name]
            return IsaLevel(value) if level and value is not None else value
        return getattr(machine_facts(), name)

    return get


def _machine_axis(name: str, kind: AxisKind, description: str, flag: str, *,
                  values: tuple[str, ...] = (), nullable: bool = False,
                  minimum: int = 0) -> Axis:
    return Axis(name, kind, values, nullable, description, core=False,
                getter=_machine_getter(name, kind == "level"), flag=flag, minimum=minimum,
                machine=True)


#: The machine axes (``Axis.machine``): the same for every call of a process.
MACHINE_AXES: Mapping[str, Axis] = MappingProxyType({a.name: a for a in (
    _machine_axis("cpu_vendor", "enum", "the CPU's vendor (intel, amd, arm, apple, other)",
                  "--cpu-vendor", values=CPU_VENDORS),
    _machine_axis("cpu_isa", "level", "the instruction-set level torch's CPU kernels run, "
                  "ordered within an architecture: x86_64 < avx2 < avx512 < avx512_bf16 < "
                  "amx; neon < sve < sve2", "--cpu-isa", values=ISA_LEVELS, nullable=True),
    _machine_axis("cores", "int", "CPU cores this process may run on", "--cores",
                  minimum=1),
    _machine_axis("threads", "int", "torch's intra-op threads when the machine was read",
                  "--threads", minimum=1),
    _machine_axis("gpu_vendor", "enum", "the GPU torch can use: cuda, rocm, xpu, mps, or "
                  "none", "--gpu-vendor", values=GPU_VENDORS, nullable=True),
)})

def _traced(ctx: Any) -> bool:
    return bool(ctx.extra.get("traced", False))


#: ``traced``: the decision is for a call torch.compile traces (not read off the call: the
#: traced decision states it in ``extra``, an eager one never does). Where a row would
#: stand in the graph as an operator of its own, its table says where that was measured
#: to beat what inductor makes of torch's operations (``not traced or ...``).
TRACED_AXIS = Axis("traced", "bool", description="the call is traced by torch.compile "
                   "(a decision taken while tracing)", core=False, getter=_traced,
                   default=False, flag="--traced")

#: Every axis an expression may name: the core axes, ``traced``, then the machine axes.
EXPRESSION_AXES: Mapping[str, Axis] = MappingProxyType(
    {**AXES, TRACED_AXIS.name: TRACED_AXIS, **MACHINE_AXES})


def context_fields(ctx: CallContext) -> dict[str, Any]:
    """The call's axes by name, typed for JSON: ints, bools, None and strings as they are,
    a dtype (or any other value) as the name the grammar writes."""

    def plain(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        return format_value(value)

    fields = {name: plain(value) for name, value in zip(CORE_AXES, _read_core(ctx), strict=True)}
    fields.update({k: plain(v) for k, v in sorted(ctx.extra.items())})
    return fields


def context_from_fields(family: str, fields: Mapping[str, Any]) -> CallContext:
    """The context whose ``context_fields`` are ``fields`` (a core axis's value given as
    the grammar writes it, a dtype by its name); names that are not core axes go to
    ``extra``. ``ValueError`` naming the axis for a value it cannot take."""
    core: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name, value in fields.items():
        axis = AXES.get(name)
        if axis is None:
            extra[name] = value
            continue
        try:
            core[name] = axis.parse(format_value(value))
        except ValueError as exc:
            raise ValueError(f"axis {name!r}: {exc}") from None
    return CallContext(family, **core, extra=extra or EMPTY)


def call_key(ctx: CallContext) -> str:
    """A call's label, e.g. ``attention[fwd=decode dtype=bfloat16 ndim=3 has_cache=true]``.

    Axes at their default value are left out; the label is the same in every process.
    """
    parts = [f"{name}={format_value(getattr(ctx, name))}" for name, axis in AXES.items()
             if getattr(ctx, name) != axis.default]
    parts += [f"{k}={format_value(v)}" for k, v in sorted(ctx.extra.items())]
    return f"{ctx.family}[{' '.join(parts)}]"


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
    """The names an expression may use: the core axes and predicates, a family's extra
    axes, and its table's definitions (``define:``). A definition maps to its named
    ``Spec``, already built, or to the reason it cannot be used where it is looked up (a
    ``str``: a definition cycle), which the parser reports at the name."""

    axes: Mapping[str, Axis] = field(default_factory=lambda: EXPRESSION_AXES)
    predicates: Mapping[str, tuple[str, str]] = field(default_factory=lambda: PREDICATES)
    definitions: Mapping[str, Any] = field(default_factory=lambda: EMPTY)

    def with_extras(self, extras: Mapping[str, Axis]) -> Vocabulary:
        """This vocabulary plus a family's extra axes."""
        merged = dict(self.axes)
        merged.update(extras)
        return dataclasses.replace(self, axes=merged)

    def with_definitions(self, definitions: Mapping[str, Any]) -> Vocabulary:
        """This vocabulary with a table's definitions (replacing any it had)."""
        return dataclasses.replace(self, definitions=MappingProxyType(dict(definitions)))

    def names(self) -> list[str]:
        """Every name that may start an atom (axes and predicates)."""
        return sorted([*self.axes, *self.predicates])


CORE_VOCABULARY = Vocabulary()
