"""Scoped overrides (contract §3, §6): ``op_backend``, ``set/get/reset_override``,
``use_profile``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from astrai.dispatch import (
    current_overrides,
    current_profiles,
    get_override,
    list_families,
    list_profiles,
    load_tables,
    op_backend,
    reset_override,
    resolve,
    set_override,
    use_profile,
)
from tests import _impls
from tests.conftest import ctx

pytestmark = pytest.mark.usefixtures("toy")

TOY_ROWS = "fast, lowp, gone, ref, for_explicit, for_context, for_env, for_profile"


class TestOpBackend:
    """``op_backend``: strict per-family selection for a scope."""

    def test_selects_rows(self) -> None:
        """Inside the block the named row serves the family, with origin 'context'."""
        with op_backend(toy="for_context"):
            res = resolve("toy", ctx(3))
            assert get_override("toy") == "for_context"
        assert (res.name, res.origin) == ("for_context", "context")
        assert get_override("toy") is None

    def test_several_families(self) -> None:
        """One scope can select rows of several families."""
        with op_backend(toy="for_context", rotary="reference"):
            assert dict(current_overrides()) == {"toy": "for_context", "rotary": "reference"}
        assert dict(current_overrides()) == {}

    def test_error_unknown_family_before_body(self) -> None:
        """An unknown family is a ValueError listing the families; the body never runs."""
        ran = []
        with pytest.raises(ValueError) as err, op_backend(toys="fast"):
            ran.append(True)
        assert ran == []
        assert str(err.value) == (
            f"Unknown family: 'toys' (did you mean 'toy'?); known families: "
            f"{', '.join(list_families())}"
        )

    def test_error_unknown_row_before_body(self) -> None:
        """An unknown row name is a ValueError listing the rows; the body never runs."""
        ran = []
        with pytest.raises(ValueError) as err, op_backend(toy="fsat"):
            ran.append(True)
        assert ran == []
        assert str(err.value) == (
            f"Unknown toy implementation: 'fsat' (did you mean 'fast'?); rows: {TOY_ROWS}"
        )

    def test_error_leaves_no_partial_scope(self) -> None:
        """When one name is bad, none of the scope's selections takes effect."""
        with op_backend(toy="fast"):
            with pytest.raises(ValueError), op_backend(toy="for_context", rotary="nope"):
                pass
            assert dict(current_overrides()) == {"toy": "fast"}

    def test_unavailable_row_passes_validation(self) -> None:
        """Entry validates names only; whether the row can serve a call is decided per call."""
        with op_backend(toy="gone"):
            assert get_override("toy") == "gone"

    def test_objects_pass_through(self) -> None:
        """Implementation objects are not validated and are kept as given."""
        picky = _impls.Picky()
        with op_backend(toy=picky):
            assert get_override("toy") is picky

    def test_nesting_restores(self) -> None:
        """An inner scope overrides the outer one and is undone on exit."""
        with op_backend(toy="for_context"):
            with op_backend(toy="for_env"):
                inner = resolve("toy", ctx(3)).name
            outer = resolve("toy", ctx(3)).name
        assert (inner, outer, resolve("toy", ctx(3)).name) == ("for_env", "for_context", "fast")

    def test_nesting_merges_families(self) -> None:
        """An inner scope for another family keeps the outer family's selection."""
        with op_backend(toy="for_context"), op_backend(rotary="reference"):
            assert dict(current_overrides()) == {"toy": "for_context", "rotary": "reference"}

    def test_none_clears(self) -> None:
        """``None`` removes the outer selection for the block only."""
        with op_backend(toy="for_context"):
            with op_backend(toy=None):
                cleared = resolve("toy", ctx(3))
                assert get_override("toy") is None
            assert get_override("toy") == "for_context"
        assert (cleared.name, cleared.origin) == ("fast", "chain")

    def test_restores_after_exception(self) -> None:
        """Leaving the block by an exception restores the outer selection."""
        with pytest.raises(RuntimeError), op_backend(toy="for_context"):
            raise RuntimeError("boom")
        assert get_override("toy") is None

    def test_validates_against_active_profiles(
        self, write_yaml: Callable[[str, str], Path]
    ) -> None:
        """A row added by an active profile is a valid name inside that profile's scope."""
        load_tables(write_yaml("add.yaml", """\
            version: 1
            profile: toy-add
            families:
              toy:
                add:
                  - name: extra
                    impl: tests._impls:adhoc
            """))
        with pytest.raises(ValueError), op_backend(toy="extra"):
            pass
        with use_profile("toy-add"), op_backend(toy="extra"):
            assert resolve("toy", ctx(3)).name == "extra"


class TestSetOverride:
    """``set_override``: the non-context-manager form of ``op_backend``."""

    def test_set_and_reset(self) -> None:
        """The override holds until its token is reset."""
        token = set_override("toy", "for_context")
        try:
            assert resolve("toy", ctx(3)).name == "for_context"
        finally:
            reset_override(token)
        assert resolve("toy", ctx(3)).name == "fast"

    def test_none_clears(self) -> None:
        """Setting ``None`` clears an override until reset."""
        outer = set_override("toy", "for_context")
        inner = set_override("toy", None)
        try:
            assert get_override("toy") is None
        finally:
            reset_override(inner)
        assert get_override("toy") == "for_context"
        reset_override(outer)
        assert get_override("toy") is None

    def test_error_unknown_row(self) -> None:
        """An unknown row is a ValueError and sets nothing."""
        with pytest.raises(ValueError) as err:
            set_override("toy", "nope")
        assert str(err.value) == f"Unknown toy implementation: 'nope'; rows: {TOY_ROWS}"
        assert get_override("toy") is None

    def test_error_unknown_family(self) -> None:
        """An unknown family is a ValueError."""
        with pytest.raises(ValueError, match=r"^Unknown family: 'nofamily'"):
            set_override("nofamily", "x")


class TestGetOverride:
    """``get_override``: the handle in force for a family."""

    def test_absent(self) -> None:
        """Without a scope there is no override."""
        assert get_override("toy") is None

    def test_unknown_family_is_none(self) -> None:
        """Asking about a family nobody selected is ``None``, whatever the name."""
        assert get_override("nofamily") is None


class TestResetOverride:
    """``reset_override``: undo a ``set_override``."""

    def test_restores_previous(self) -> None:
        """Resetting returns to the value before the matching ``set_override``."""
        a = set_override("toy", "for_context")
        b = set_override("toy", "for_env")
        reset_override(b)
        assert get_override("toy") == "for_context"
        reset_override(a)
        assert get_override("toy") is None


class TestCurrentOverrides:
    """``current_overrides``: every override in force."""

    def test_read_only(self) -> None:
        """The mapping cannot be changed in place."""
        with op_backend(toy="fast"):
            got = current_overrides()
            with pytest.raises(TypeError):
                got["toy"] = "ref"  # type: ignore[index]


class TestUseProfile:
    """``use_profile``: activate profiles for a scope."""

    def test_applies_in_scope(self) -> None:
        """The profile applies inside the block only."""
        with use_profile("toy-force"):
            assert resolve("toy", ctx(3)).name == "for_profile"
            assert current_profiles() == ("toy-force",)
        assert resolve("toy", ctx(3)).name == "fast"
        assert current_profiles() == ()

    def test_nesting_appends(self) -> None:
        """Nested scopes add profiles after the outer ones, and restore on exit."""
        with use_profile("toy-enable"):
            with use_profile("toy-disable", "toy-force"):
                assert current_profiles() == ("toy-enable", "toy-disable", "toy-force")
            assert current_profiles() == ("toy-enable",)

    def test_after_env_profiles(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Scoped profiles apply after those from ASTR_OPS, so a scoped force wins."""
        monkeypatch.setenv("ASTR_OPS", "profile=toy-force-fast")
        assert resolve("toy", ctx(3)).name == "fast"
        with use_profile("toy-force"):
            assert resolve("toy", ctx(3)).name == "for_profile"

    def test_error_unknown_profile(self) -> None:
        """An unknown profile is a ValueError listing the known ones; the body never runs."""
        ran = []
        with pytest.raises(ValueError) as err, use_profile("toy-forse"):
            ran.append(True)
        assert ran == []
        assert str(err.value) == (
            f"unknown profile 'toy-forse' (did you mean 'toy-force'?); known profiles: "
            f"{', '.join(list_profiles())}"
        )
        assert current_profiles() == ()
