"""``explain`` and ``explain_plan`` (contract §8): the trace, and its agreement with ``resolve``."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch

from astrai.dispatch import (
    CallContext,
    explain,
    explain_plan,
    load_tables,
    op_backend,
    resolve,
    use_profile,
)
from tests import _impls
from tests.conftest import ctx

pytestmark = pytest.mark.usefixtures("toy")

HEADER = ("[toy] fwd=none dtype=none device_cuda=false ndim={ndim} head_dim=none "
          "has_cache=false has_mask=false grad_enabled=true")
#: The toy rows after ``fast`` as the chain sees them for any call.
REST = [
    "  lowp: SKIP not faithful (explicit-only)",
    "  gone: SKIP unavailable (no widget on this machine)",
    "  ref: MATCH (always)  (fallback)",
    "  for_explicit: MATCH (always)",
    "  for_context: MATCH (always)",
    "  for_env: MATCH (always)",
    "  for_profile: MATCH (always)",
]
DECISION = re.compile(r"^=> (?:(?P<row>\S+) \(origin=(?P<origin>\w+)\)|ERROR: (?P<error>.*))$",
                      re.S)


class TestExplain:
    """``explain``: one line per row in priority order, then the decision."""

    def test_chain_decision(self, toy: Path) -> None:
        """A call the first row accepts: its MATCH line, the table's file, the decision."""
        assert explain("toy", ctx(3)).splitlines() == [
            HEADER.format(ndim=3),
            "  fast: MATCH (ndim == 3)",
            *REST,
            f"  table: {toy} (load_tables)",
            "=> fast (origin=chain)",
        ]

    def test_reject_names_clause_and_value(self) -> None:
        """A rejecting row names the failed clause and the value the call had."""
        assert [line for line in explain("toy", ctx(2)).splitlines()
                if not line.startswith("  table: ")] == [
            HEADER.format(ndim=2),
            "  fast: reject (ndim == 3 (call has 2))",
            *REST,
            "=> ref (origin=chain)",
        ]

    def test_reject_first_failing_clause(self, write_yaml: Callable[[str, str], Path]) -> None:
        """Of a conjunction, the first clause that fails is the one named."""
        load_tables(write_yaml("conj.yaml", """\
            version: 1
            family: conj
            fallback: ref
            rows:
              - name: picky
                impl: tests._impls:fast
                when: dtype in {float16, bfloat16} and ndim == 3 and not has_mask
              - name: ref
                impl: tests._impls:ref
            """))
        call = CallContext("conj", dtype=torch.float16, ndim=3, has_mask=True)
        assert explain("conj", call).splitlines()[1] == (
            "  picky: reject (not has_mask (call has has_mask=true))"
        )
        assert explain("conj", call.evolve(dtype=torch.float32)).splitlines()[1] == (
            "  picky: reject (dtype in {float16, bfloat16} (call has float32))"
        )

    def test_header(self) -> None:
        """The header shows every axis of the call, in the grammar's spelling."""
        call = CallContext("toy", fwd="decode", dtype=torch.bfloat16, device_cuda=True, ndim=3,
                           head_dim=128, has_cache=True, has_mask=True, grad_enabled=False)
        assert explain("toy", call).splitlines()[0] == (
            "[toy] fwd=decode dtype=bfloat16 device_cuda=true ndim=3 head_dim=128 "
            "has_cache=true has_mask=true grad_enabled=false"
        )

    def test_extra_axes(self, write_yaml: Callable[[str, str], Path]) -> None:
        """A family's declared axes follow the core ones in the header and in verdicts."""
        load_tables(write_yaml("ax.yaml", """\
            version: 1
            family: ax
            axes:
              - name: span
                type: int
                nullable: true
              - name: causal
                type: bool
            fallback: ref
            rows:
              - name: windowed
                impl: tests._impls:fast
                when: span >= 64
              - name: ref
                impl: tests._impls:ref
                when: causal
            """))
        call = CallContext("ax", extra={"span": 128, "causal": False})
        assert explain("ax", call).splitlines()[:-2] + explain("ax", call).splitlines()[-1:] == [
            "[ax] fwd=none dtype=none device_cuda=false ndim=none head_dim=none "
            "has_cache=false has_mask=false grad_enabled=true causal=false span=128",
            "  windowed: MATCH (span >= 64)",
            "  ref: reject (causal (call has causal=false))  (fallback)",
            "=> windowed (origin=chain)",
        ]
        lines = explain("ax", call.evolve(extra={"span": None, "causal": False})).splitlines()
        assert lines[1] == "  windowed: reject (span >= 64 (call has none))"
        assert lines[-3:] == [
            "=> ERROR: no ax row can serve this call, not even the fallback 'ref'; call: "
            "fwd=none dtype=none device_cuda=false ndim=none head_dim=none has_cache=false "
            "has_mask=false grad_enabled=true causal=false span=none",
            "  windowed: requires span >= 64 (call has none)",
            "  ref (fallback): requires causal (call has causal=false)",
        ]

    def test_disabled_by_profile(self) -> None:
        """A row a profile disables says which profile; the active profiles are listed."""
        with use_profile("toy-disable"):
            lines = explain("toy", ctx(3)).splitlines()
        assert lines[:3] == [
            HEADER.format(ndim=3),
            "  profiles: toy-disable",
            "  fast: SKIP disabled by profile toy-disable",
        ]
        assert lines[-1] == "=> ref (origin=chain)"

    def test_enabled_by_profile(self) -> None:
        """A non-faithful row a profile enables matches, saying which profile enabled it."""
        with use_profile("toy-enable"):
            lines = explain("toy", ctx(2)).splitlines()
        assert "  lowp: MATCH (always; enabled by profile toy-enable)" in lines
        assert lines[-1] == "=> lowp (origin=chain)"

    def test_profile_force(self) -> None:
        """A forcing profile's decision shows as origin 'profile'."""
        with use_profile("toy-force"):
            lines = explain("toy", ctx(3)).splitlines()
        assert lines[1] == "  profiles: toy-force"
        assert lines[-1] == "=> for_profile (origin=profile)"

    def test_explicit(self) -> None:
        """An explicit row's decision shows as origin 'explicit'; row lines are unchanged."""
        lines = explain("toy", ctx(2), "for_explicit").splitlines()
        assert lines[1:-2] == ["  fast: reject (ndim == 3 (call has 2))", *REST]
        assert lines[-1] == "=> for_explicit (origin=explicit)"

    def test_context(self) -> None:
        """An op_backend scope's decision shows as origin 'context'."""
        with op_backend(toy="lowp"):
            assert explain("toy", ctx(3)).splitlines()[-1] == "=> lowp (origin=context)"

    def test_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An ASTR_OPS entry's decision shows as origin 'env'."""
        monkeypatch.setenv("ASTR_OPS", "toy=for_env")
        assert explain("toy", ctx(3)).splitlines()[-1] == "=> for_env (origin=env)"

    def test_error_explicit_unavailable(self) -> None:
        """A strict failure ends the trace with ``=> ERROR:`` and the error's message."""
        assert explain("toy", ctx(3), "gone").splitlines()[-1] == (
            "=> ERROR: toy implementation 'gone' selected by the explicit argument cannot "
            "serve this call: unavailable (no widget on this machine)"
        )

    def test_error_explicit_unknown(self) -> None:
        """An unknown explicit name ends the trace with the ValueError's message."""
        assert explain("toy", ctx(3), "nope").splitlines()[-1] == (
            "=> ERROR: Unknown toy implementation: 'nope'; rows: fast, lowp, gone, ref, "
            "for_explicit, for_context, for_env, for_profile"
        )

    def test_error_adhoc_refuses(self) -> None:
        """An ad hoc object whose ``supports_call`` refuses ends the trace with an error."""
        last = explain("toy", ctx(3), _impls.Picky()).splitlines()[-1]
        assert last.startswith("=> ERROR: toy implementation 'picky' selected by the explicit "
                               "argument cannot serve this call")

    def test_error_unknown_family(self) -> None:
        """An unknown family is a KeyError, as for ``resolve``."""
        with pytest.raises(KeyError):
            explain("nofamily", CallContext("nofamily"))

    def test_env_fall_through_is_noted(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """When an env entry cannot serve the call the trace says why before the decision."""
        monkeypatch.setenv("ASTR_OPS", "toy=gone")
        lines = explain("toy", ctx(3)).splitlines()
        assert any("gone" in line and "no widget on this machine" in line
                   for line in lines if line.startswith("  note: "))
        assert lines[-1] == "=> fast (origin=chain)"

    def test_agrees_with_resolve_on_grid(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """On every combination of call, handles and profiles, explain states what resolve does."""
        picky = _impls.Picky()
        calls = [ctx(n, dtype=dt).evolve(raw_kwargs={"ok": ok})
                 for n, dt, ok in itertools.product((None, 2, 3), (None, torch.float16),
                                                     (True, False))]
        explicits: list[Any] = [None, "fast", "lowp", "gone", "nope", _impls.adhoc, picky]
        contexts: list[Any] = [None, "fast", "for_context", picky]
        envs = ["", "toy=for_env", "toy=fast", "toy=gone", "toy=nope"]
        profiles = [(), ("toy-force",), ("toy-force-fast",), ("toy-enable", "toy-disable"),
                    ("reference",)]
        checked = 0
        for env_value, prof, scoped in itertools.product(envs, profiles, contexts):
            monkeypatch.setenv("ASTR_OPS", env_value)
            with ExitStack() as stack:
                stack.enter_context(use_profile(*prof))
                stack.enter_context(op_backend(toy=scoped))
                for call, explicit in itertools.product(calls, explicits):
                    try:
                        res = resolve("toy", call, explicit)
                        want = {"row": res.name, "origin": res.origin, "error": None}
                    except (ValueError, RuntimeError) as exc:
                        want = {"row": None, "origin": None, "error": str(exc)}
                    last = explain("toy", call, explicit).splitlines()
                    got = DECISION.match("\n".join(last[-1:]))
                    assert got is not None, last
                    assert got.groupdict() == want, (env_value, prof, scoped, call, explicit)
                    checked += 1
        assert checked == len(envs) * len(profiles) * len(contexts) * len(calls) * len(explicits)


class TestExplainPlan:
    """``explain_plan``: one ``explain`` block per family."""

    def test_blocks(self) -> None:
        """The plan is the families' explanations, in order, separated by blank lines."""
        attention = CallContext("attention", dtype=torch.float32, ndim=4)
        got = explain_plan({"toy": ctx(3), "attention": attention})
        assert got == explain("toy", ctx(3)) + "\n\n" + explain("attention", attention)
        assert got.split("\n\n")[1].startswith("[attention] ")

    def test_explicit(self) -> None:
        """Explicit handles are given per family."""
        got = explain_plan({"toy": ctx(3)}, {"toy": "for_explicit"})
        assert got.splitlines()[-1] == "=> for_explicit (origin=explicit)"

    def test_error_in_one_block(self) -> None:
        """A strict failure shows in its own block without hiding the others."""
        attention = CallContext("attention", dtype=torch.float32, ndim=4)
        blocks = explain_plan({"toy": ctx(3), "attention": attention}, {"toy": "gone"}).split(
            "\n\n")
        assert blocks[0].splitlines()[-1].startswith("=> ERROR: ")
        assert blocks[1].splitlines()[-1].startswith("=> ")
        assert not blocks[1].splitlines()[-1].startswith("=> ERROR")
