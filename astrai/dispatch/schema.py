"""A family's contract stated once: its facade's typed signature, from which the checks,
the compiled reading, the facade function and the rows' signature check all follow.

A ``Schema`` names the facade's parameters in order, each a ``Tensor`` (a shape written
with symbols, ``"..., f"`` or ``"f"``; optional; floating; of another parameter's dtype) or
a ``Scalar`` (``float``, ``int`` or ``bool``, with bounds), and its main tensor (the first
``Tensor`` unless named): the call's base axes are the main tensor's ``dtype``,
``device_cuda`` and ``ndim`` and ``grad_enabled``; its lazy axes are ``device`` and ``sm``
and, where the main tensor's shape starts with ``...``, ``tokens`` (the product of those
leading sizes).

From the schema, with nothing written twice:

- ``describe`` checks a call and raises a located error naming the parameter, what was
  expected and what was given (``TypeError`` for a wrong kind, ``ValueError`` for a wrong
  value or shape), or returns the base axes' values;
- ``reading`` is the compiled hot path's ``Reading``: one guard per constraint. A
  constraint its guards cannot state (a bound other than ``>= 0`` or ``> 0``, an int other
  than one value) makes the schema's reading ``None``: every call then takes the Python
  route, where ``describe`` checks it; the compiled path never skips a check;
- ``facade()`` makes the facade function, with the family's own signature (and
  ``backend=None``) and no frame of its own between the caller and the row;
- ``row_problem(impl)`` says why a row's function cannot take the facade's arguments
  (a table load refuses such a row, naming it).
"""

from __future__ import annotations

__all__ = ["Choice", "Scalar", "Schema", "Tensor"]

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Literal

import torch

from astrai.dispatch import state as process
from astrai.dispatch.facade import (
    Facade,
    FamilyCall,
    device_axes,
    facade,
    leading_rows,
)
from astrai.dispatch.reading import Case, Op, Reading
from astrai.dispatch.tables.model import source_place
from astrai.dispatch.torch_compile import compiling
from astrai.errors import TableError, TableProblem

_HALF = (torch.float16, torch.bfloat16)
#: The base axes every schema's call fills, in order.
READS = ("dtype", "device_cuda", "ndim", "grad_enabled")
_NONE = 0  # the index of ``None`` in a reading's constants


@dataclass(frozen=True)
class Tensor:
    """A tensor parameter. ``shape``: comma-separated dimensions, each a symbol (a name:
    every dimension of that name, in any parameter, has one size) or a size; a leading
    ``...`` allows any number of leading dimensions (``"..., f"``; ``""`` is a scalar
    tensor). ``optional``: ``None`` may be given (and is the default). ``floating``: a
    floating-point dtype. ``dtype``: the dtype of the parameter it names (``float32_too``:
    or float32, where that one is float16 or bfloat16; the compiled path reads the
    same dtype alone, and leaves float32 to the Python route); ``like``: the very shape
    of the parameter it names."""

    shape: str
    optional: bool = False
    floating: bool = False
    dtype: str | None = None
    like: str | None = None
    float32_too: bool = False

    def dims(self) -> tuple[bool, tuple[str | int, ...]]:
        """``(leading ..., the named dimensions)``."""
        parts = [p.strip() for p in self.shape.split(",") if p.strip()]
        lead = bool(parts) and parts[0] == "..."
        named = parts[1:] if lead else parts
        out: list[str | int] = []
        for p in named:
            if p == "...":
                raise ValueError(f"shape {self.shape!r}: '...' may only come first")
            if p.isdigit():
                out.append(int(p))
            elif p.isidentifier():
                out.append(p)
            else:
                raise ValueError(f"shape {self.shape!r}: {p!r} is neither a symbol nor a size")
        return lead, tuple(out)

    def written(self) -> str:
        return f"[{self.shape}]"


@dataclass(frozen=True)
class Scalar:
    """A plain value: ``kind`` ``float`` (an int is taken too, never a bool), ``int`` or
    ``bool``, with optional bounds (``ge``, ``gt``, ``le``, ``lt``; an ``int`` also
    ``eq``) and a default."""

    kind: Literal["float", "int", "bool"]
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    eq: int | None = None
    default: Any = inspect.Parameter.empty

    def written(self) -> str:
        """``float > 0``, ``int == 2``, ``bool``: the kind and its bounds."""
        bounds = [f"{op} {v:g}" for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le),
                                             ("<", self.lt), ("==", self.eq)) if v is not None]
        return " and ".join([f"{self.kind} {bounds[0]}", *bounds[1:]]) if bounds else self.kind

    def problem(self, value: Any) -> tuple[type[Exception], str] | None:
        """Why ``value`` is not one (the exception type and what was expected), or
        ``None``."""
        want = self.written()
        if self.kind == "bool":
            return None if type(value) is bool else (TypeError, want)
        if isinstance(value, bool) or not isinstance(value, int | float) or (
                self.kind == "int" and not isinstance(value, int)):
            return TypeError, want
        ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
              and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
              and (self.eq is None or value == self.eq))
        return None if ok else (ValueError, want)

    def guard(self, i: int) -> Op | None:
        """The compiled path's guard stating every constraint, or ``None`` where its guards
        cannot."""
        if self.kind == "bool":
            return ("bool", i)
        if self.kind == "int":
            only_eq = self.eq is not None and (self.ge, self.gt, self.le, self.lt) == (None,) * 4
            return ("int_eq", i, self.eq) if only_eq else None
        if (self.le, self.lt, self.eq) != (None, None, None):
            return None
        if self.ge is None and self.gt is None:
            return ("float", i)
        if self.gt is None and self.ge == 0:
            return ("float_ge0", i)
        if self.ge is None and self.gt == 0:
            return ("float_gt0", i)
        return None


@dataclass(frozen=True)
class Choice:
    """One of ``values`` (strings; the compiled path reads the very objects of ``values``
    and leaves any other equal string to the Python route). ``axis``: the family's axis
    of that name takes the value (a base axis: in the decision key). ``noun``: what the
    message calls the values (``activations``)."""

    values: tuple[str, ...]
    axis: str | None = None
    noun: str | None = None
    default: Any = inspect.Parameter.empty

    def written(self) -> str:
        return "one of " + ", ".join(self.values)


Param = Tensor | Scalar | Choice


@dataclass(frozen=True)
class Schema:
    """A family's facade stated once (module docstring): ``family``, its parameters in
    order, the main tensor (default: the first ``Tensor``), and where the facade function
    is said to live (``module``, for its ``__module__``)."""

    family: str
    params: Mapping[str, Param]
    main: str | None = None
    doc: str = ""
    module: str | None = None
    # What the parameters say, read once: their order, each tensor's shape (``dims``),
    # every named dimension (``_symbols``), and the reading's constants.
    _order: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _dims: dict[str, tuple[bool, tuple[str | int, ...]]] = field(
        init=False, repr=False, compare=False)
    _named: tuple[tuple[str, int, str | int, int], ...] = field(
        init=False, repr=False, compare=False)
    _consts: tuple[Any, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = tuple(self.params)
        object.__setattr__(self, "_order", names)
        if not names:
            raise ValueError(f"schema {self.family!r}: no parameters")
        bad = [n for n in names if not n.isidentifier() or n == "backend"]
        if bad:
            raise ValueError(f"schema {self.family!r}: {', '.join(map(repr, bad))} cannot "
                             f"name a parameter")
        tensors = [n for n, p in self.params.items() if isinstance(p, Tensor)]
        main = self.main or (tensors[0] if tensors else None)
        if main is None or main not in tensors or self.params[main].optional:  # type: ignore[union-attr]
            raise ValueError(f"schema {self.family!r}: the main tensor must be a required "
                             f"Tensor parameter (tensors: {', '.join(tensors) or 'none'})")
        object.__setattr__(self, "main", main)
        dims = {n: p.dims() for n, p in self.params.items() if isinstance(p, Tensor)}
        object.__setattr__(self, "_dims", dims)  # (a malformed shape raises here)
        object.__setattr__(self, "_named", tuple(
            (name, names.index(name), d, k - len(ds) if lead else k)
            for name, (lead, ds) in dims.items() for k, d in enumerate(ds)))
        consts: list[Any] = [None, True, False]
        for p in self.params.values():
            if isinstance(p, Choice):
                consts.extend(p.values)
        object.__setattr__(self, "_consts", tuple(consts))
        seen_default = False
        for name, p in self.params.items():
            if isinstance(p, Tensor):
                for what, other in (("dtype", p.dtype), ("like", p.like)):
                    if other is not None and other not in tensors:
                        raise ValueError(f"schema {self.family!r}: {name}'s {what} names "
                                         f"{other!r}, which is no tensor parameter")
            has_default = self.default(name) is not inspect.Parameter.empty
            if seen_default and not has_default:
                raise ValueError(f"schema {self.family!r}: {name} has no default but "
                                 f"follows a parameter that has one")
            seen_default = seen_default or has_default

    # -- what follows from it --------------------------------------------------------------

    def default(self, name: str) -> Any:
        p = self.params[name]
        if isinstance(p, Tensor):
            return None if p.optional else inspect.Parameter.empty
        return p.default

    def signature(self) -> str:
        """The facade's signature in words: ``softcap(x: [..., f], cap: float > 0)``."""
        def one(name: str, p: Param) -> str:
            text = f"{name}: {p.written()}"
            if isinstance(p, Tensor) and p.optional:
                text += " or None"
            return text
        return f"{self.family}({', '.join(one(n, p) for n, p in self.params.items())})"

    def _index(self, name: str) -> int:
        return self._order.index(name)

    def describe(self, *args: Any) -> tuple[Any, ...]:
        """The base axes' values of the call ``args`` (the facade's full argument tuple),
        after checking every constraint (a located ``TypeError`` or ``ValueError``)."""
        fam = self.family
        for (name, p), value in zip(self.params.items(), args, strict=True):
            if isinstance(p, Scalar):
                got = p.problem(value)
                if got is not None:
                    article = "an" if got[1][:1] in "aeiou" else "a"
                    raise got[0](f"{fam}: {name} must be {article} {got[1]}, got {value!r}")
            elif isinstance(p, Choice):
                if not isinstance(value, str) or value not in p.values:
                    raise ValueError(f"{fam}: unknown {name} {value!r}; "
                                     f"{p.noun or name + ' values'}: {', '.join(p.values)}")
            elif value is None:
                if not p.optional:
                    raise TypeError(f"{fam}: {name} must be a torch.Tensor, got None")
            elif not isinstance(value, torch.Tensor):
                raise TypeError(f"{fam}: {name} must be a torch.Tensor"
                                f"{' or None' if p.optional else ''}, got "
                                f"{type(value).__name__}")
        tensors = {n: v for n, v in zip(self._order, args, strict=True)
                   if isinstance(self.params[n], Tensor) and v is not None}

        def shapes() -> str:
            return ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors.items())

        for name, t in tensors.items():
            p = self.params[name]
            assert isinstance(p, Tensor)
            lead, dims = self._dims[name]
            if (t.dim() < len(dims)) if lead else (t.dim() != len(dims)):
                least = "at least " if lead else ""
                raise ValueError(f"{fam}: {name} must be {p.written()} ({least}{len(dims)} "
                                 f"dimension{'s' if len(dims) != 1 else ''}); got {shapes()}")
            if p.floating and not t.dtype.is_floating_point:
                raise ValueError(f"{fam}: {name} must be floating point, got {t.dtype}")
            if p.dtype is not None and p.dtype in tensors and t.dtype != tensors[p.dtype].dtype:
                other = tensors[p.dtype].dtype
                if not (p.float32_too and t.dtype == torch.float32 and other in _HALF):
                    too = (", or float32 with a float16 or bfloat16 " + p.dtype
                           if p.float32_too else "")
                    raise ValueError(f"{fam}: {name} must have {p.dtype}'s dtype ({other})"
                                     f"{too}, got {t.dtype}")
            if p.like is not None and p.like in tensors and t.shape != tensors[p.like].shape:
                raise ValueError(f"{fam}: {name} must have {p.like}'s shape "
                                 f"{tuple(tensors[p.like].shape)}, got {tuple(t.shape)}")
        bound: dict[str, tuple[str, int, int]] = {}
        for name, _i, d, a in self._named:
            if name not in tensors:
                continue
            size = tensors[name].shape[a]
            if isinstance(d, int):
                if size != d:
                    raise ValueError(f"{fam}: {name}.shape[{a}] must be {d}, got {size}; "
                                     f"got {shapes()}")
            elif d in bound:
                other, b, want = bound[d]
                if size != want:
                    raise ValueError(f"{fam}: {name}.shape[{a}] must equal {d} = "
                                     f"{other}.shape[{b}] = {want}, got {size}; got {shapes()}")
            else:
                bound[d] = (name, a, size)
        m = tensors[self.main]  # type: ignore[index]
        return (m.dtype, m.is_cuda, m.dim(), torch.is_grad_enabled(),
                *(args[i] for i in self._axes()))

    def _axes(self) -> tuple[int, ...]:
        """The indexes of the parameters whose values are axes, in order."""
        return tuple(i for i, p in enumerate(self.params.values())
                     if isinstance(p, Choice) and p.axis is not None)

    @property
    def reads(self) -> tuple[str, ...]:
        """The base axes ``describe`` returns, in order."""
        axes = [self.params[self._order[i]] for i in self._axes()]
        return (*READS, *(p.axis for p in axes if isinstance(p, Choice) and p.axis))

    def _lead(self) -> int | None:
        """How many named dimensions follow the main tensor's ``...`` (``None``: none)."""
        lead, dims = self._dims[self.main]  # type: ignore[index]
        return len(dims) if lead else None

    def readers(self) -> dict[str, Callable[..., Any]]:
        """The lazy axes and their readers (given the full argument tuple)."""
        m = self._index(self.main)  # type: ignore[arg-type]
        out: dict[str, Callable[..., Any]] = {
            "device": lambda *a: device_axes(a[m])[0],
            "sm": lambda *a: device_axes(a[m])[1]}
        k = self._lead()
        if k is not None:
            out["tokens"] = leading_rows(m, k)
        return out

    def reading(self) -> Reading | None:
        """The compiled path's reading, one case per choice of the optional tensors given
        or ``None``; ``None`` where a constraint has no guard (``unreadable``)."""
        if self.unreadable() is not None:
            return None
        m = self._index(self.main)  # type: ignore[arg-type]
        optional = [n for n, p in self.params.items() if isinstance(p, Tensor) and p.optional]
        lazy: dict[str, Op] = {"device": ("device", m), "sm": ("sm", m)}
        k = self._lead()
        if k is not None:
            lazy["tokens"] = ("rows", m, k)
        base: tuple[Op, ...] = (("dtype", m), ("cuda", m), ("ndim", m), ("grad",),
                                *(("arg", i) for i in self._axes()))
        cases = []
        for given in product((True, False), repeat=len(optional)):
            absent = {n for n, g in zip(optional, given, strict=True) if not g}
            cases.append(Case(self._guards(absent), base, lazy))
        return Reading(len(self._order), tuple(cases), self._consts)

    def _guards(self, absent: set[str]) -> tuple[Op, ...]:
        out: list[Op] = []
        for name, p in self.params.items():
            i = self._index(name)
            if isinstance(p, Scalar):
                g = p.guard(i)
                assert g is not None  # unreadable() said so first
                out.append(g)
                continue
            if isinstance(p, Choice):
                at = self._choice_at(name)
                out.append(("any", *((("is", i, at + k),) for k in range(len(p.values)))))
                continue
            if name in absent:
                out.append(("is", i, _NONE))
                continue
            lead, dims = self._dims[name]
            out.append(("tensor", i))
            out.append(("ndim_ge", i, len(dims)) if lead else ("ndim", i, len(dims)))
            if p.floating:
                out.append(("floating", i))
            if p.dtype is not None and p.dtype not in absent:
                out.append(("dtype_eq", i, self._index(p.dtype)))
            if p.like is not None and p.like not in absent:
                out.append(("shape_eq", i, self._index(p.like)))
        first: dict[str, tuple[int, int]] = {}
        for name, i, d, a in self._named:
            if name in absent:
                continue
            if isinstance(d, int):
                out.append(("size_is", i, a, d))
            elif d in first:
                out.append(("size_eq", i, a, *first[d]))
            else:
                first[d] = (i, a)
        return tuple(out)

    def _choice_at(self, name: str) -> int:
        """Where choice parameter ``name``'s values start among the reading's constants:
        ``None``, ``True``, ``False``, then every choice's values in order."""
        at = 3
        for other, p in self.params.items():
            if other == name:
                return at
            if isinstance(p, Choice):
                at += len(p.values)
        raise KeyError(name)

    def unreadable(self) -> str | None:
        """Why the compiled path reads none of the family's calls (a constraint its
        guards cannot state), or ``None``."""
        hard = [f"{n}: {p.written()}" for n, p in self.params.items()
                if isinstance(p, Scalar) and p.guard(0) is None]
        if hard:
            return (f"the compiled path cannot check {'; '.join(hard)}: every call takes "
                    f"the Python route, which does")
        return None

    def facade(self) -> Facade:
        """The family's facade: its function generated with the schema's signature (and
        ``backend=None``), registered (``astrai.dispatch.facade.facade``)."""
        made: list[Facade] = []
        function = _function(self, made)
        call = FamilyCall.of(function, self.describe, self.reads, self.readers(),
                             positional=len(self._order), reading=self.reading(),
                             family=self.family)
        self._check_loaded()  # a refused declaration registers nothing
        made.append(facade(call))
        process.row_checks[self.family] = self.row_problem
        return made[0]

    def _check_loaded(self) -> None:
        """Every row of the family loaded already, checked (a table loaded before the
        declaration): a ``TableError`` naming each row whose function cannot take the
        facade's arguments, at its file and line."""
        snapshot = process.snapshot
        table = None if snapshot is None else snapshot.families.get(self.family)
        if table is None:
            return
        problems = []
        for row in table.rows:
            wrong = self.row_problem(row.obj)
            if wrong is None:
                continue
            file, line = source_place(row.source or "?")
            problems.append(TableProblem(file, line, 0, f"row {row.name!r}: {wrong}"))
        if problems:
            raise TableError(problems)

    def row_problem(self, impl: Callable[..., Any]) -> str | None:
        """Why ``impl`` cannot be called with the facade's arguments (positionally, in
        the schema's order), or ``None``."""
        try:
            sig = inspect.signature(impl)
        except (TypeError, ValueError):
            return None  # a builtin without a signature: nothing to check
        try:
            sig.bind(*self._order)
        except TypeError as e:
            return (f"it cannot take {self.signature()} positionally ({e}); its "
                    f"signature is {sig}")
        return None


def _function(schema: Schema, made: list[Facade]) -> Callable[..., Any]:
    """The facade function of ``schema``: for every call, the hot path's decision where
    it has one, else the route's; written out with the parameters' names."""
    names = schema._order
    params = []
    defaults: dict[str, Any] = {}
    for n in names:
        d = schema.default(n)
        if d is inspect.Parameter.empty:
            params.append(n)
        else:
            defaults[f"_d_{n}"] = d
            params.append(f"{n}=_d_{n}")
    args = ", ".join(names)
    text = (f"def {schema.family}({', '.join(params)}, backend=None):\n"
            f"    f = _made[0]\n"
            f"    if backend is None and not _compiling() and f.lookup is not None:\n"
            f"        d = f.lookup(f.last, {args})\n"
            f"        if d is not None:\n"
            f"            next(d.counter)\n"
            f"            return d.call({args})\n"
            f"    return f.route(backend, ({args},))({args})\n")
    space: dict[str, Any] = {"_made": made, "_compiling": compiling, **defaults}
    exec(compile(text, f"<astrai facade {schema.family}>", "exec"), space)
    fn: Callable[..., Any] = space[schema.family]
    fn.__annotations__ = {n: _annotation(p) for n, p in schema.params.items()}
    # (said on the function alone: its globals are its own, which torch.compile reads)
    fn.__module__ = schema.module or __name__
    fn.__doc__ = schema.doc or f"``{schema.signature()}`` through the {schema.family} table."
    fn.__qualname__ = schema.family
    return fn


def _annotation(p: Param) -> Any:
    """What a parameter is, as a facade function's annotation says it."""
    if isinstance(p, Tensor):
        return torch.Tensor | None if p.optional else torch.Tensor
    if isinstance(p, Choice):
        return str
    return {"float": float, "int": int, "bool": bool}[p.kind]
