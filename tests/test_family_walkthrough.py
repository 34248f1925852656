"""The walkthrough of docs/families.md, run as written: a family of three files (table,
rows, declaration) gets its facade, the compiled hot path, ``ops.call`` and model
recognition; and no module outside a built-in family's own package, its rows and demo
code names a built-in family."""

from __future__ import annotations

import ast
import importlib
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import astrai
import astrai.dispatch as d
from astrai import ops
from astrai.dispatch.expr.analysis import comparisons
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.facade import FACADES
from astrai.dispatch.keying import KeyPlan
from astrai.dispatch.reading import encode, read
from astrai.families import declared, every_family, undeclare
from astrai.integrations.transformers import (
    dispatch_model,
    restore_model,
    verify_model,
)
from tests.test_key_plans import _python_key

DOCS = Path(__file__).parent.parent / "docs" / "families.md"
FILES = ("scaleshift/scale_shift.yaml", "scaleshift/rows.py", "scaleshift/declaration.py")


def _blocks() -> dict[str, str]:
    """The walkthrough's files: each fenced block whose first line names one."""
    text = DOCS.read_text(encoding="utf-8")
    out: dict[str, str] = {}
    for block in re.findall(r"```(?:python|yaml)\n(.*?)```", text, re.DOTALL):
        first = block.splitlines()[0]
        for name in FILES:
            if first == f"# {name}":
                out[name] = block
    return out


@pytest.fixture
def family(tmp_path: Path) -> Iterator[ModuleType]:
    """The three files written as the walkthrough has them, the table loaded and the
    declaration imported (forgotten again afterwards)."""
    blocks = _blocks()
    assert sorted(blocks) == sorted(FILES), "docs/families.md lost a walkthrough file"
    for name, text in blocks.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        d.load_tables(tmp_path / "scaleshift" / "scale_shift.yaml")
        yield importlib.import_module("scaleshift.declaration")
    finally:
        undeclare("scale_shift")
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("scaleshift")]:
            del sys.modules[name]


def _call(tokens: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return (torch.randn(tokens, 8, dtype=dtype), torch.randn(8, dtype=dtype),
            torch.randn(8, dtype=dtype))


def test_the_walkthrough_touches_three_files() -> None:
    assert len(_blocks()) == 3


def test_its_facade_validates_decides_and_counts(family: ModuleType) -> None:
    d.reset_stats()
    x, s, b = _call(4)
    torch.testing.assert_close(family.scale_shift(x, s, b), x * s + b)
    one = _call(1)
    torch.testing.assert_close(ops.call("scale_shift", *one),
                               ops.call("scale_shift", *one, backend="reference"))
    served = d.stats().by_row()["scale_shift"]
    assert served == {"fused": {"chain": 1}, "reference": {"chain": 1, "explicit": 1}}
    with pytest.raises(ValueError, match=r"scale_shift: scale.shape\[0\] must equal f = "):
        family.scale_shift(x, s[:4], b)
    ctx = ops.context("scale_shift", *_call(5))
    assert (ctx.tokens, ctx.ndim, ctx.dtype) == (5, 2, torch.float32)
    assert "=> fused" in d.explain("scale_shift", ctx)


def test_it_gets_the_compiled_hot_path(family: ModuleType, hot: ModuleType) -> None:
    """The compiled path reads its calls from the declaration's Reading, under the
    table's cut point on ``tokens``, and answers what the route decided."""
    facade = FACADES["scale_shift"]
    assert ops.compiled_path()["scale_shift"] is None
    for tokens, row in ((1, "reference"), (3, "fused")):
        args = _call(tokens)
        assert hot.lookup(facade.last, *args) is None or tokens == 3  # not decided yet
        family.scale_shift(*args)
        decided = hot.lookup(facade.last, *args)
        assert decided is not None
        assert decided.call is facade.plain(None, args)
        assert decided.call.__name__ == row
    d.reset_stats()
    family.scale_shift(*_call(7))
    assert d.stats().by_row()["scale_shift"] == {"fused": {"chain": 1}}
    assert hot.lookup(facade.last, torch.randn(2, 8), torch.randn(8), torch.randn(3)) is None


class ScaleShift(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))
        self.shift = nn.Parameter(torch.randn(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


class Lookalike(ScaleShift):
    """Holds what a scale-shift holds, computes something else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale - self.shift


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.proj, self.last = ScaleShift(8), nn.Linear(8, 8), ScaleShift(8)
        self.odd = Lookalike(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.last(self.proj(self.first(x))))


def test_dispatch_model_routes_it_in_a_model(family: ModuleType) -> None:
    torch.manual_seed(0)
    model, x = Toy(), torch.randn(2, 3, 8)
    with torch.no_grad():
        want = model(x)
        report = dispatch_model(model)
        assert report.counts()["scale_shift"] == 2
        assert sorted(report.paths("scale_shift")) == ["first", "last"]
        odd = [n for n in report.not_routed if n.path == "odd"]
        assert [(n.family, n.reason) for n in odd] == [
            ("scale_shift", "its forward does not compute x * scale + shift")]
        d.reset_stats()
        torch.testing.assert_close(model(x), want)
        assert d.stats().by_row()["scale_shift"] == {"fused": {"chain": 2}}  # 6 tokens
        assert verify_model(model, x)["scale_shift"] == 2
        restore_model(model)
        torch.testing.assert_close(model(x), want)
    assert "scale_shift" not in dispatch_model(model, ["linear"]).counts()


def test_verify_model_names_a_routed_module_the_model_did_not_call(family: ModuleType) -> None:
    model = Toy()
    dispatch_model(model, ["scale_shift"])
    model.forward = lambda x: model.proj(x)  # type: ignore[method-assign]
    got = verify_model(model, torch.randn(2, 8))
    assert got == {"scale_shift": 0}
    assert got.unreached == {
        f"scale_shift ({path} ScaleShift)": "the model did not call it with these inputs"
        for path in ("first", "last")}


def test_forgotten_family_leaves_its_table_to_ops_call(family: ModuleType) -> None:
    undeclare("scale_shift")
    assert declared("scale_shift") is None and "scale_shift" not in FACADES
    x, s, b = _call(2)
    torch.testing.assert_close(ops.call("scale_shift", x, s, b), x * s + b)


# -- nothing outside a family's own code names it ---------------------------------------

_ROOT = Path(astrai.__file__).parent
#: A built-in family's own code (its package, its rows) and the demos may name it.
_OWN = ("families/", "backends/", "native/kernels.cpp")
_DEMOS = ("demo.py", "integrations/transformers/demo.py", "models/llama.py")
#: The public namespaces re-exporting a family's facade or adapter (imports, __all__).
_REEXPORTS = ("ops/__init__.py", "integrations/transformers/__init__.py")


def _builtin_names() -> set[str]:
    """The built-in families' names and their facades' (a family whose facade is
    declared in astrai's own package)."""
    names = set()
    for name, fam in every_family().items():
        if fam.facades[0].function.__module__.startswith("astrai.families."):
            names.add(name)
            names.update(f.name for f in fam.facades)
    return names


def _mentions(path: Path, names: set[str], rel: str | None = None) -> list[str]:
    """``line: what`` for each string constant (docstrings aside) equal to a name and each
    import of a built-in family's package."""
    rel = rel or path.relative_to(_ROOT).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)):
            skip.add(id(body[0].value))
        if rel in _REEXPORTS and isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            skip.update(id(n) for n in ast.walk(node.value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in skip and node.value in names:
            found.append(f"{rel}:{node.lineno}: {node.value!r}")
        if isinstance(node, ast.ImportFrom) and node.module and rel not in _REEXPORTS:
            parts = node.module.split(".")
            if parts[:2] == ["astrai", "families"] and len(parts) > 2 and parts[2] in names:
                found.append(f"{rel}:{node.lineno}: import {node.module}")
    return found


def test_no_module_outside_a_family_names_it() -> None:
    names = _builtin_names()
    assert {"attention", "rotary", "rotary_half", "rms_norm", "linear"} <= names
    found: list[str] = []
    for path in sorted(_ROOT.rglob("*.py")):
        rel = path.relative_to(_ROOT).as_posix()
        if not rel.startswith(_OWN) and rel not in _DEMOS:
            found += _mentions(path, names)
    hot = (_ROOT / "native" / "hot.cpp").read_text(encoding="utf-8")
    found += [f"native/hot.cpp: {n}" for n in sorted(names) if re.search(rf"\b{n}\b", hot)]
    assert found == []


def test_the_check_sees_a_family_named_in_code(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('"""rms_norm in a docstring is fine."""\nX = "rms_norm"\n'
                     "from astrai.families.linear import linear\n", encoding="utf-8")
    assert sorted(_mentions(probe, _builtin_names(), "dispatch/probe.py")) == [
        "dispatch/probe.py:2: 'rms_norm'", "dispatch/probe.py:3: import astrai.families.linear"]


# -- the walkthrough's Reading agrees with its describe ---------------------------------


def _toy_args(rng: random.Random) -> tuple[Any, ...]:
    """A call of scale_shift: mostly well formed, sometimes not (shapes, dtypes, types)."""
    dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
    shape = rng.choice([(1, 8), (3, 8), (2, 5, 8), (8,), (300, 8), (0, 8)])
    x = torch.zeros(shape, dtype=dtype)
    f = rng.choice([8, 8, 8, 7])
    scale = torch.zeros(f, dtype=rng.choice([dtype, dtype, torch.float16]))
    shift: Any = rng.choice([torch.zeros(f, dtype=dtype), torch.zeros(f, dtype=dtype),
                             torch.zeros(1, f, dtype=dtype), 1.0])
    return x, scale, shift


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(points=st.lists(st.integers(0, 400), max_size=3), device=st.booleans(),
       seed=st.integers(0, 10_000), grad=st.booleans())
def test_its_compiled_key_is_its_python_key(family: ModuleType, built: ModuleType,
                                            points: list[int], device: bool, seed: int,
                                            grad: bool) -> None:
    """For random calls under random tables (cut points on ``tokens``, ``device``
    compared or not), the compiled path's key of a call is what the declaration's
    ``Reading`` means, and the route's own key; it answers every well-formed call."""
    texts = [f"tokens >= {p}" for p in points] + (["device == cpu"] if device else [])
    plan = KeyPlan("scale_shift", comparisons([Spec.parse(t) for t in texts]))
    fc = FACADES["scale_shift"].call
    shape = plan.layout(fc.reads, fc.lazy)
    made = built.plan(*encode(fc.reading, shape))  # type: ignore[arg-type]
    rng = random.Random(seed)
    with torch.set_grad_enabled(grad):
        for _ in range(25):
            args = _toy_args(rng)
            compiled = built.key(made, *args)
            assert compiled == read(fc.reading, shape, args)  # type: ignore[arg-type]
            python = _python_key("scale_shift", plan, args)
            if isinstance(python, BaseException):
                assert compiled is None, args
            else:
                assert compiled == python, (args, shape)
