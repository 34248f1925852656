"""``ASTR_OPS`` and legacy single-value aliases (contract §7, §2 ``register_env_alias``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from astrai.dispatch import (
    OPS_ENV,
    CallContext,
    current,
    explain,
    list_families,
    list_profiles,
    load_tables,
    register_env_alias,
    resolve,
)
from tests.conftest import TOY_TABLE, ctx

pytestmark = pytest.mark.usefixtures("toy")

TOY_ROWS = "fast, lowp, gone, ref, for_explicit, for_context, for_env, for_profile"


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The messages logged as warnings on the ``astrai`` logger."""
    return [r.getMessage() for r in caplog.records
            if r.name == "astrai" and r.levelno == logging.WARNING]


def outcome(family: str = "toy", call: CallContext | None = None) -> tuple[str, str]:
    """``(row, origin)`` that serves ``call``."""
    res = resolve(family, call if call is not None else ctx(3))
    return res.name, res.origin


def attention_call() -> CallContext:
    """A dense float32 attention call on the CPU (no cache)."""
    return CallContext("attention", dtype=torch.float32, ndim=4, head_dim=64)


class TestOpsEnv:
    """Parsing of ``ASTR_OPS``: ``family=row`` entries and ``profile=a+b``."""

    def test_name(self) -> None:
        """The variable is called ASTR_OPS."""
        assert OPS_ENV == "ASTR_OPS"

    def test_families_and_profiles(self, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
        """Family entries select rows and ``profile=a+b`` applies profiles in order."""
        monkeypatch.setenv("ASTR_OPS", "toy=for_env,attention=math,profile=toy-enable+toy-disable")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            assert outcome() == ("for_env", "env")
            assert outcome("attention", attention_call()) == ("math", "env")
            assert outcome("toy", ctx(2).evolve(ndim=5)) == ("for_env", "env")
            assert explain("toy", ctx(3)).splitlines()[1] == "  profiles: toy-enable + toy-disable"
        assert warnings(caplog) == []

    def test_profiles_apply_in_order(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Of two forcing profiles, the later one in the list wins."""
        monkeypatch.setenv("ASTR_OPS", "profile=toy-force+toy-force-fast")
        assert outcome() == ("fast", "profile")
        monkeypatch.setenv("ASTR_OPS", "profile=toy-force-fast+toy-force")
        assert outcome() == ("for_profile", "profile")

    def test_profile_only(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A profile entry alone changes the chain without selecting a row."""
        monkeypatch.setenv("ASTR_OPS", "profile=toy-disable")
        assert outcome() == ("ref", "chain")

    def test_whitespace_and_empty_entries(self, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
        """Spaces around keys and values and empty entries are tolerated silently."""
        monkeypatch.setenv("ASTR_OPS", " , toy = for_env ,, profile = toy-enable ,")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            assert outcome() == ("for_env", "env")
            assert "  profiles: toy-enable" in explain("toy", ctx(3)).splitlines()
        assert warnings(caplog) == []

    def test_empty_value(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An empty ASTR_OPS is the same as none."""
        monkeypatch.setenv("ASTR_OPS", "")
        assert outcome() == ("fast", "chain")

    @pytest.mark.parametrize("entry", ["toy", "=for_env", "toy=", "toy:for_env", "="])
    def test_error_malformed_entry_warns_once(self, entry: str,
                                              monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
        """A malformed entry warns once and is dropped; the other entries still apply."""
        monkeypatch.setenv("ASTR_OPS", f"{entry},attention=math")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            for n in (3, 2, 3, 2):
                resolve("toy", ctx(n))
            explain("toy", ctx(3))
            assert outcome("attention", attention_call()) == ("math", "env")
        assert outcome() == ("fast", "chain")
        assert warnings(caplog) == [
            f"ASTR_OPS: ignoring malformed entry {entry!r}; expected 'family=row' or "
            f"'profile=name[+name...]'"
        ]

    def test_error_unknown_family_warns_once(self, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
        """An unknown family warns once, listing the known ones, and is dropped."""
        monkeypatch.setenv("ASTR_OPS", "toys=fast,toy=for_env")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            got = [outcome("toy", ctx(n)) for n in (3, 2, 3)]
            explain("toy", ctx(3))
        assert got == [("for_env", "env")] * 3
        assert warnings(caplog) == [
            f"ASTR_OPS: ignoring unknown family 'toys' (did you mean 'toy'?); known families: "
            f"{', '.join(list_families())}, or 'profile'"
        ]

    def test_error_unknown_profile_warns_once(self, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
        """An unknown profile warns once and is dropped; the known ones still apply."""
        monkeypatch.setenv("ASTR_OPS", "profile=toy-forse+toy-disable")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            got = [outcome("toy", ctx(n)) for n in (3, 2, 3)]
        assert got == [("ref", "chain")] * 3
        assert warnings(caplog) == [
            f"ASTR_OPS: ignoring unknown profile 'toy-forse' (did you mean 'toy-force'?); "
            f"known profiles: {', '.join(list_profiles())}"
        ]

    def test_error_empty_profile_name(self, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
        """A stray ``+`` is an empty name: one plain warning, the named profile applies."""
        monkeypatch.setenv("ASTR_OPS", "profile=toy-disable+")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            got = [outcome("toy", ctx(3)) for _ in range(2)]
        assert got == [("ref", "chain")] * 2
        assert warnings(caplog) == [
            "ASTR_OPS: ignoring an empty profile name in 'profile=toy-disable+'"
        ]

    def test_error_unknown_row_warns_once(self, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
        """An entry naming no row warns once, says where it came from, and is ignored."""
        monkeypatch.setenv("ASTR_OPS", "toy=fsat")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            got = [outcome("toy", ctx(n)) for n in (3, 3, 2)]
            explain("toy", ctx(3))
        assert got == [("fast", "chain"), ("fast", "chain"), ("ref", "chain")]
        assert warnings(caplog) == [
            f"Unknown toy implementation: 'fsat' from ASTR_OPS (toy=fsat) "
            f"(did you mean 'fast'?); ignored; rows: {TOY_ROWS}"
        ]

    def test_error_several_problems_each_warn(self, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
        """Several bad entries in one value each warn once; none is fatal."""
        monkeypatch.setenv("ASTR_OPS", "junk,nofamily=x,profile=nope,toy=for_env")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            for _ in range(3):
                assert outcome() == ("for_env", "env")
        got = warnings(caplog)
        assert len(got) == 3
        assert [g.split(" ", 3)[2] for g in got] == ["malformed", "unknown", "unknown"]

    def test_error_repeated_family(self, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
        """A family given twice warns and the last entry wins."""
        monkeypatch.setenv("ASTR_OPS", "toy=for_context,toy=for_env")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            assert outcome() == ("for_env", "env")
        assert warnings(caplog) == ["ASTR_OPS: 'toy' is given twice; using 'for_env'"]

    def test_changed_value_next_call(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A changed value takes effect on the very next call."""
        monkeypatch.setenv("ASTR_OPS", "toy=for_env")
        assert outcome() == ("for_env", "env")
        monkeypatch.setenv("ASTR_OPS", "toy=for_context")
        assert outcome() == ("for_context", "env")
        monkeypatch.setenv("ASTR_OPS", "profile=toy-force")
        assert outcome() == ("for_profile", "profile")
        monkeypatch.delenv("ASTR_OPS")
        assert outcome() == ("fast", "chain")

    def test_warning_again_after_value_returns(self, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
        """A problem already reported in this process is not reported again."""
        with caplog.at_level(logging.WARNING, logger="astrai"):
            for value in ("toys=x", "toy=for_env", "toys=x"):
                monkeypatch.setenv("ASTR_OPS", value)
                outcome()
        assert len(warnings(caplog)) == 1

    def test_never_on_root_logger(self, monkeypatch: pytest.MonkeyPatch,
                                  caplog: pytest.LogCaptureFixture) -> None:
        """Warnings go to the ``astrai`` logger, not the root logger."""
        monkeypatch.setenv("ASTR_OPS", "junk")
        with caplog.at_level(logging.WARNING):
            outcome()
        assert [r.name for r in caplog.records] == ["astrai"]


class TestLegacyAlias:
    """Legacy single-value variables (``ASTR_BACKEND`` for attention, registered aliases)."""

    def test_shipped_attention_alias(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``ASTR_BACKEND`` selects the attention row, with origin 'env'."""
        assert current().families["attention"].env_alias == "ASTR_BACKEND"
        default = outcome("attention", attention_call())
        monkeypatch.setenv("ASTR_BACKEND", "math")
        assert outcome("attention", attention_call()) == ("math", "env")
        monkeypatch.delenv("ASTR_BACKEND")
        assert outcome("attention", attention_call()) == default

    def test_ops_entry_wins_over_alias(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """When both name a row, the ``ASTR_OPS`` entry wins."""
        monkeypatch.setenv("ASTR_BACKEND", "math")
        monkeypatch.setenv("ASTR_OPS", "attention=torch_native")
        assert outcome("attention", attention_call()) == ("torch_native", "env")

    def test_alias_beside_other_ops_entries(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An ``ASTR_OPS`` without an entry for the family leaves the alias in force."""
        monkeypatch.setenv("ASTR_BACKEND", "math")
        monkeypatch.setenv("ASTR_OPS", "toy=for_env,profile=toy-enable")
        assert outcome("attention", attention_call()) == ("math", "env")

    def test_registered_alias(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``register_env_alias`` makes a variable select the family's row."""
        register_env_alias("toy", "ASTR_TEST_TOY")
        monkeypatch.setenv("ASTR_TEST_TOY", "for_env")
        assert outcome() == ("for_env", "env")
        monkeypatch.setenv("ASTR_OPS", "toy=for_context")
        assert outcome() == ("for_context", "env")

    def test_alias_blank_value_ignored(self, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
        """An empty or blank alias value is the same as an unset one."""
        register_env_alias("toy", "ASTR_TEST_TOY")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            for value in ("", "   "):
                monkeypatch.setenv("ASTR_TEST_TOY", value)
                assert outcome() == ("fast", "chain")
        assert warnings(caplog) == []

    def test_error_alias_unknown_row_warns_once(self, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
        """An alias naming no row warns once, naming the variable, and is ignored."""
        register_env_alias("toy", "ASTR_TEST_TOY")
        monkeypatch.setenv("ASTR_TEST_TOY", "fsat")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            got = [outcome("toy", ctx(n)) for n in (3, 2, 3)]
        assert got == [("fast", "chain"), ("ref", "chain"), ("fast", "chain")]
        assert warnings(caplog) == [
            f"Unknown toy implementation: 'fsat' from ASTR_TEST_TOY (toy=fsat) "
            f"(did you mean 'fast'?); ignored; rows: {TOY_ROWS}"
        ]

    def test_alias_incapable_row_falls_through(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An alias row that cannot serve the call falls through like an ASTR_OPS entry."""
        register_env_alias("toy", "ASTR_TEST_TOY")
        monkeypatch.setenv("ASTR_TEST_TOY", "gone")
        assert outcome() == ("fast", "chain")

    def test_alias_from_table(self, write_yaml: Callable[[str, str], Path],
                              monkeypatch: pytest.MonkeyPatch) -> None:
        """A table's ``env_alias`` key declares the family's legacy variable."""
        load_tables(write_yaml("aliased.yaml", TOY_TABLE.replace(
            "fallback: ref", "env_alias: ASTR_TEST_TOY\nfallback: ref")))
        monkeypatch.setenv("ASTR_TEST_TOY", "for_env")
        assert outcome() == ("for_env", "env")
