"""The public surface of ``astrai.dispatch``: what it exports and how its errors are typed."""

from __future__ import annotations

import importlib
import pickle

import pytest

import astrai.dispatch as dispatch
import astrai.errors as errors
from astrai.dispatch import (
    AstraiError,
    CallContext,
    ExplicitSelectionError,
    FileFormatError,
    LockDriftError,
    NoImplementationError,
    OutputPathError,
    SpecSyntaxError,
    TableError,
    TableProblem,
    UnknownFamilyError,
)

#: Each public error and the builtin closest in meaning (STYLE: both bases).
ERRORS = [
    (ExplicitSelectionError, RuntimeError),
    (FileFormatError, ValueError),
    (LockDriftError, RuntimeError),
    (NoImplementationError, RuntimeError),
    (OutputPathError, OSError),
    (SpecSyntaxError, ValueError),
    (TableError, ValueError),
    (UnknownFamilyError, KeyError),
]


#: Public errors that ``astrai.dispatch`` does not export, and the module that re-exports them.
OTHER_HOMES = {
    "KVCacheFullError": "astrai.kv_cache",
    "StaleBatchError": "astrai.kv_cache",
    "UnsupportedFeatureError": "astrai.integrations.transformers",
}


class TestAll:
    """``astrai.dispatch.__all__``."""

    @pytest.mark.parametrize("name", dispatch.__all__)
    def test_every_name_imports(self, name: str) -> None:
        """Every name in ``__all__`` is an attribute of the package."""
        assert getattr(dispatch, name) is not None

    def test_star_import(self) -> None:
        """``from astrai.dispatch import *`` binds exactly ``__all__``."""
        ns: dict[str, object] = {}
        exec("from astrai.dispatch import *", ns)
        assert set(ns) - {"__builtins__"} == set(dispatch.__all__)

    def test_no_duplicates(self) -> None:
        """``__all__`` lists each name once."""
        assert len(dispatch.__all__) == len(set(dispatch.__all__))

    def test_spec_names(self) -> None:
        """The names contract §2, §3 and §8 promise are exported."""
        promised = {
            "CallContext", "Spec", "parse_spec", "ImplRecord", "register_family",
            "register_env_alias", "Resolution", "ExplicitSelectionError", "resolve",
            "resolve_plan", "op_backend", "use_profile", "load_tables", "reload_tables",
            "refresh", "explain", "explain_plan",
        }
        assert promised <= set(dispatch.__all__)

    def test_errors_module_all(self) -> None:
        """``astrai.errors`` exports the same error classes as ``astrai.dispatch`` (and, for
        the KV cache's and the transformers plug-in's errors, as their own modules)."""
        for name in errors.__all__:
            home = importlib.import_module(OTHER_HOMES.get(name, "astrai.dispatch"))
            assert getattr(home, name) is getattr(errors, name)


class TestErrors:
    """The public error classes."""

    @pytest.mark.parametrize(("cls", "builtin"), ERRORS, ids=[c.__name__ for c, _ in ERRORS])
    def test_bases(self, cls: type[Exception], builtin: type[Exception]) -> None:
        """Each error subclasses both ``AstraiError`` and the closest builtin."""
        assert issubclass(cls, AstraiError)
        assert issubclass(cls, builtin)

    def test_base_is_exception(self) -> None:
        """``AstraiError`` is an ordinary exception."""
        assert issubclass(AstraiError, Exception)

    def test_unknown_family_caught_as_key_error(self) -> None:
        """``resolve`` on an unknown family can be caught as a plain KeyError."""
        with pytest.raises(KeyError):
            dispatch.resolve("nofamily", CallContext("nofamily"))

    @pytest.mark.parametrize(
        "error",
        [
            ExplicitSelectionError("toy row 'x' cannot serve this call", family="toy", row="x"),
            NoImplementationError("no toy row"),
            SpecSyntaxError("unknown axis 'ndimm'", "ndimm == 3", (0, 5), file="t.yaml",
                            line=3, column=11),
            TableError([TableProblem("t.yaml", 3, 11, "duplicate row name 'a'")]),
            FileFormatError([TableProblem("w.yaml", 2, 7, "unknown key 'colour'")]),
            LockDriftError("toy drifted", family="toy", signature="toy[ndim=3]",
                           locked="fast", live="ref", reason="a table edit"),
            UnknownFamilyError("toys", ["toy", "rotary"]),
        ],
        ids=lambda e: type(e).__name__,
    )
    def test_pickle_round_trip(self, error: Exception) -> None:
        """Errors survive pickling (multiprocessing, distributed) with their message."""
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error)
        assert str(back) == str(error)

    def test_table_error_lists_problems(self) -> None:
        """A TableError renders one ``file:line:col: message`` line per problem."""
        err = TableError([TableProblem("a.yaml", 1, 2, "x"), TableProblem("b.yaml", 3, 4, "y")])
        assert str(err) == "a.yaml:1:2: x\nb.yaml:3:4: y"
        assert [p.line for p in err.problems] == [1, 3]

    def test_explicit_selection_fields(self) -> None:
        """ExplicitSelectionError carries the family and the row."""
        err = ExplicitSelectionError("msg", family="toy", row="fast")
        assert (err.family, err.row, str(err)) == ("toy", "fast", "msg")

    def test_lock_drift_fields(self) -> None:
        """LockDriftError carries the family, the call, both rows and the reason, also
        through pickling."""
        err = LockDriftError("msg", family="toy", signature="toy[ndim=3]", locked="fast",
                             live=None, reason="a new signature")
        back = pickle.loads(pickle.dumps(err))
        assert (back.family, back.signature, back.locked, back.live, back.reason) == (
            "toy", "toy[ndim=3]", "fast", None, "a new signature")

    def test_unknown_family_fields(self) -> None:
        """UnknownFamilyError carries the name and the sorted known families."""
        err = UnknownFamilyError("toys", ["toy", "rotary"])
        assert (err.family, err.known) == ("toys", ["rotary", "toy"])
        assert str(err) == ("Unknown family: 'toys' (did you mean 'toy'?); known families: "
                            "rotary, toy")


def test_facade_contexts_read_the_right_axes() -> None:
    """Each facade's axis values land on the right axes (the order of ``<FAMILY>_READS``
    and of what ``describe_<family>`` returns agree)."""
    import torch

    from astrai import ops

    q, kv = torch.randn(2, 3, 4, 8, dtype=torch.float64), torch.randn(2, 5, 2, 8,
                                                                      dtype=torch.float64)
    with torch.no_grad():
        ctx = ops.context("attention", q, kv, kv, attn_mask=torch.ones(1, dtype=torch.bool))
    assert (ctx.fwd, ctx.dtype, ctx.device_cuda, ctx.ndim, ctx.head_dim, ctx.has_cache,
            ctx.has_mask, ctx.grad_enabled) == (None, torch.float64, False, 4, 8, False,
                                                True, False)
    x = torch.randn(3, 5, 2, 6, dtype=torch.float16)
    ctx = ops.context("rotary", x, torch.randn(5, 3, 2))
    assert (ctx.dtype, ctx.ndim, ctx.head_dim, ctx.grad_enabled) == (torch.float16, 4, 6, True)
    ctx = ops.context("rms_norm", x, torch.ones(6, dtype=torch.float16))
    assert (ctx.dtype, ctx.ndim, ctx.head_dim) == (torch.float16, 4, None)
    ctx = ops.context("linear", x, torch.ones(7, 6, dtype=torch.float16))
    assert (ctx.dtype, ctx.ndim, ctx.has_cache) == (torch.float16, 4, False)
