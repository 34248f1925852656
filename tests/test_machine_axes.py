"""The machine axes: what a table may ask of the machine (vendor, instruction set, cores,
threads, GPU vendor), read once per process, stated for another machine in explain, lint
and ``assume_machine``, and moved between machines by YAML alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import astrai.dispatch as dispatch
from astrai.dispatch import hardware
from astrai.dispatch.axes import MACHINE_AXES, CallContext
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.hardware import IsaLevel, isa_level
from astrai.dispatch.lint import lint_family
from astrai.errors import SpecSyntaxError

X86_512 = frozenset({"avx2", "avx512f"})


@pytest.mark.parametrize(("machine", "flags", "capability", "want"), [
    ("x86_64", frozenset({"sse4_2"}), "DEFAULT", "x86_64"),
    ("x86_64", frozenset({"avx2"}), "AVX2", "avx2"),
    ("x86_64", X86_512, "AVX512", "avx512"),
    ("x86_64", X86_512 | {"avx512_bf16"}, "AVX512", "avx512_bf16"),
    ("x86_64", X86_512 | {"avx512_bf16", "amx_tile"}, "AVX512", "amx"),
    # torch's kernels held to AVX2 (ATEN_CPU_CAPABILITY=avx2) on an AVX-512 CPU
    ("x86_64", X86_512 | {"amx_tile"}, "AVX2", "avx2"),
    ("x86_64", X86_512, "DEFAULT", "x86_64"),
    ("aarch64", frozenset({"asimd"}), "DEFAULT", "neon"),
    ("aarch64", frozenset({"asimd", "sve"}), "SVE256", "sve"),
    ("aarch64", frozenset({"asimd", "sve", "sve2"}), "SVE256", "sve2"),
    ("riscv64", frozenset(), "", None),
])
def test_the_level_is_the_one_torch_kernels_run(machine: str, flags: frozenset[str],
                                                 capability: str, want: str | None) -> None:
    assert hardware._isa(machine, flags, capability) == want


@pytest.mark.parametrize(("vendor_id", "machine", "want"), [
    ("GenuineIntel", "x86_64", "intel"), ("AuthenticAMD", "x86_64", "amd"),
    ("HygonGenuine", "x86_64", "amd"), ("", "aarch64", "arm"), ("", "riscv64", "other")])
def test_the_vendor_is_named_as_tables_write_it(vendor_id: str, machine: str,
                                                want: str) -> None:
    assert hardware._vendor(vendor_id, machine) == want


def test_levels_order_within_an_architecture_only() -> None:
    avx2, avx512, neon = isa_level("avx2"), isa_level("avx512"), isa_level("neon")
    assert avx2 < avx512 and avx512 >= avx2 and avx512 > avx2 and avx2 <= avx2
    assert avx512 == "avx512" and hash(avx512) == hash("avx512")
    for x, y in ((neon, avx2), (avx2, neon)):
        assert not (x < y or x <= y or x > y or x >= y)
    with pytest.raises(ValueError, match="levels: x86_64, avx2"):
        isa_level("avx3")


def test_this_machine_is_read_once_and_again_after_refresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    first = hardware.machine_facts()
    assert first is hardware.machine_facts()
    assert first.cores >= 1 and first.threads == torch.get_num_threads()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, before - 1) if before > 1 else 2)
        assert hardware.machine_facts().threads == before  # read once
        dispatch.refresh()
        assert hardware.machine_facts().threads == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
        dispatch.refresh()


class TestGrammar:
    def test_an_instruction_set_compares_in_order(self) -> None:
        spec = Spec.parse("cpu_isa >= avx512 and cpu_vendor == amd")
        on = {"cpu_isa": "avx512", "cpu_vendor": "amd"}
        for extra, want in ((on, True), ({**on, "cpu_isa": "amx"}, True),
                            ({**on, "cpu_isa": "avx2"}, False),
                            ({**on, "cpu_isa": "sve"}, False),
                            ({**on, "cpu_vendor": "intel"}, False)):
            ctx = CallContext("linear", extra=extra)
            assert spec.matches(ctx) is want and spec.matcher()(ctx) is want

    def test_this_machine_answers_where_the_call_states_nothing(self) -> None:
        here = hardware.machine_facts()
        ctx = CallContext("linear")
        assert Spec.parse(f"cores == {here.cores}").matches(ctx)
        assert Spec.parse(f"cpu_vendor == {here.cpu_vendor}").matches(ctx)
        assert not Spec.parse(f"cores != {here.cores}").matches(ctx)

    def test_a_level_survives_the_plain_form(self) -> None:
        spec = Spec.parse("cpu_isa < avx512")
        back = Spec.decode(json.loads(json.dumps(spec.encode())))
        assert back == spec
        assert back.matches(CallContext("linear", extra={"cpu_isa": "avx2"}))
        assert not back.matches(CallContext("linear", extra={"cpu_isa": "neon"}))

    @pytest.mark.parametrize(("text", "message"), [
        ("cpu_isa >= avx3", "unknown value 'avx3' for 'cpu_isa' (did you mean 'avx2'?)"),
        ("cpu_vendor >= amd", "'cpu_vendor' is not ordered"),
        ("gpu_vendor == nvidia", "unknown value 'nvidia' for 'gpu_vendor'"),
        ("cores >= many", "expected an integer for 'cores'"),
    ])
    def test_a_wrong_value_is_located(self, text: str, message: str) -> None:
        with pytest.raises(SpecSyntaxError) as info:
            Spec.parse(text)
        assert message in str(info.value)

    def test_a_family_cannot_declare_a_machine_axis(self, tmp_path: Path) -> None:
        path = tmp_path / "fam.yaml"
        path.write_text("version: 1\nfamily: fam\nfallback: a\naxes:\n  - name: cpu_isa\n"
                        "    type: int\nrows:\n  - name: a\n    impl: tests._impls:fast\n")
        with pytest.raises(dispatch.TableError, match="cpu_isa"):
            dispatch.load_tables(path)

    def test_they_never_enter_a_decision_key(self) -> None:
        a = CallContext("linear", dtype=torch.float32, ndim=2)
        assert a.signature() == CallContext("linear", dtype=torch.float32, ndim=2).signature()
        assert not set(MACHINE_AXES) & set(a.named_values()[0])


LINEAR_CALL = dict(dtype=torch.float32, ndim=2, grad_enabled=False, device="cpu")

#: The native row moved from the machines below AVX-512 to those with it, by YAML alone.
MOVED = """version: 1
profile: native-above
description: the native linear row on AVX-512 machines instead of those below
families:
  linear:
    when:
      native: >-
        device == cpu and dtype == float32 and not grad_enabled and tokens >= 2
        and tokens <= 4 and cpu_isa >= avx512
"""


def _native_loaded() -> bool:
    from astrai.backends.native import native_linear_available

    return native_linear_available() is True


class TestMovedByYaml:
    def test_a_profile_moves_a_rule_between_instruction_sets_and_explain_follows(
            self, tmp_path: Path) -> None:
        if not _native_loaded():
            pytest.skip("the native linear row is unavailable here")
        (tmp_path / "native-above.yaml").write_text(MOVED)
        dispatch.load_tables(tmp_path / "native-above.yaml")

        def winner(isa: str, *profiles: str) -> str:
            ctx = CallContext("linear", tokens=2, extra={"cpu_isa": isa, "cpu_vendor": "intel"},
                              **LINEAR_CALL)  # type: ignore[arg-type]
            with dispatch.use_profile(*profiles):
                text = dispatch.explain("linear", ctx)
                with dispatch.assume_machine(cpu_isa=isa, cpu_vendor="intel"):
                    assumed = dispatch.resolve("linear", CallContext(
                        "linear", tokens=2, **LINEAR_CALL)).name  # type: ignore[arg-type]
            said = text.splitlines()[-1].split()[1]
            assert said == assumed, text
            assert f"cpu_isa={isa} (stated; here " in text
            return said

        assert (winner("avx2"), winner("avx512")) == ("native", "torch")
        assert (winner("avx2", "native-above"), winner("avx512", "native-above")) == \
            ("torch", "native")

    def test_the_command_line_asks_about_another_machine(self, tmp_path: Path) -> None:
        if not _native_loaded():
            pytest.skip("the native linear row is unavailable here")
        (tmp_path / "native-above.yaml").write_text(MOVED)
        base = [sys.executable, "-m", "astrai", "explain", "linear", "--dtype", "float32",
                "--ndim", "2", "--no-grad", "--device", "cpu", "--tokens", "2",
                "--cpu-vendor", "intel", "--json"]
        env = {**os.environ, "ASTR_TABLES": str(tmp_path)}

        def row(*more: str) -> str:
            out = subprocess.run([*base, *more], env=env, capture_output=True, text=True,
                                 check=True).stdout
            doc = json.loads(out)
            assert doc["machine"]["cpu_vendor"] == "intel"
            assert "cpu_vendor" in doc["machine_stated"]
            return str(doc["decision"]["row"])

        assert row("--cpu-isa", "avx2") == "native"
        assert row("--cpu-isa", "avx512") == "torch"
        assert row("--cpu-isa", "avx512", "--profile", "native-above") == "native"

    def test_a_bad_machine_value_on_the_command_line_is_a_usage_error(self) -> None:
        got = subprocess.run([sys.executable, "-m", "astrai", "explain", "linear", "--tokens",
                              "2", "--cpu-isa", "avx3"], capture_output=True, text=True)
        assert got.returncode == 2 and "--cpu-isa 'avx3'" in got.stderr


class TestAssumeMachine:
    def test_decisions_follow_and_come_back(self) -> None:
        call = CallContext("linear", tokens=2, **LINEAR_CALL)  # type: ignore[arg-type]
        here = dispatch.resolve("linear", call).name
        with dispatch.assume_machine(cpu_vendor="amd", cpu_isa="avx512") as facts:
            assert facts.cpu_vendor == "amd" and isinstance(facts.cpu_isa, IsaLevel)
            inside = dispatch.resolve("linear", call).name
        assert dispatch.resolve("linear", call).name == here
        assert inside == ("native" if _native_loaded() else "torch")

    @pytest.mark.parametrize(("values", "message"), [
        ({"cpu_isa": "avx3"}, "unknown instruction-set level"),
        ({"cpu_vendor": "via"}, "unknown cpu_vendor"),
        ({"gpu_vendor": "nvidia"}, "unknown gpu_vendor"),
        ({"cores": 0}, "cores must be an integer >= 1"),
        ({"sockets": 2}, "unknown machine axis 'sockets'"),
    ])
    def test_a_value_no_machine_has_is_refused(self, values: dict[str, object],
                                               message: str) -> None:
        with pytest.raises(ValueError, match=message), dispatch.assume_machine(**values):
            pass


def test_explain_names_the_machine_where_the_table_asks_about_it() -> None:
    call = CallContext("linear", tokens=64, **LINEAR_CALL)  # type: ignore[arg-type]
    here = hardware.machine_facts()
    text = dispatch.explain("linear", call)
    assert f"  machine: cpu_vendor={here.cpu_vendor} " in text
    with dispatch.assume_machine(cpu_vendor="intel"):
        line = next(t for t in dispatch.explain("linear", call).splitlines()
                    if t.strip().startswith("onednn:"))
    assert line.endswith("(cpu_vendor == amd (this machine has intel))")
    norm = dispatch.explain("rms_norm", CallContext("rms_norm", dtype=torch.float32, ndim=2))
    assert "machine:" not in norm  # its table asks nothing of the machine


def test_lint_analyses_the_machine_axes_the_table_compares() -> None:
    report = lint_family("linear")
    text = report.render()
    header = next(t for t in text.splitlines() if t.rstrip().endswith("winner"))
    assert "cpu_vendor" in header and "cpu_isa" in header and "cores" not in header
    assert any("amd" in t and "avx512" in t and t.rstrip().endswith("onednn")
               for t in text.splitlines())


class TestNothingToGain:
    """A family whose every row but the model's own computation is out of reach here is
    left to the model's own code by ``dispatch_model``, said in its report."""

    @pytest.fixture
    def llama(self) -> torch.nn.Module:
        from tests import _zoo

        if not _zoo.available("llama"):
            pytest.skip("transformers is not installed")
        return _zoo.build("llama")

    def test_linear_is_left_where_only_torch_can_serve(self, llama: torch.nn.Module) -> None:
        from astrai.integrations.transformers import dispatch_model, restore_model
        from tests import _zoo

        feed = _zoo.inputs(llama)
        plain = _zoo.greedy(llama, feed)
        with dispatch.assume_machine(cpu_vendor="intel", cpu_isa="avx512"):
            report = dispatch_model(llama, mode="inference")
            try:
                left = dict(report.model_code)
                assert "row 'torch', which computes what the modules do" in left["linear"]
                assert "onednn: its when is false on this machine" in left["linear"]
                assert not any(r.family == "linear" for r in report.routed)
                assert not any("q_proj" in n.path for n in report.not_routed)
                assert "left to the model's own code:" in str(report)
                assert torch.equal(_zoo.greedy(llama, feed), plain)
                assert dispatch.stats().by_row().get("linear") is None
            finally:
                restore_model(llama)

    @pytest.mark.parametrize("how", ["named", "machine", "profile"])
    def test_it_is_routed_where_a_row_can_serve_or_it_is_asked_for(
            self, llama: torch.nn.Module, how: str, tmp_path: Path) -> None:
        from astrai.integrations.transformers import FAMILIES, dispatch_model, restore_model
        from tests.conftest import TRANSPOSED_ON

        machine = {"cpu_vendor": "amd" if how == "machine" else "intel", "cpu_isa": "avx512"}
        with dispatch.assume_machine(**machine):
            families = list(FAMILIES) if how == "named" else None
            if how == "profile":  # a profile enabling a row that can serve here
                (tmp_path / "transposed-on.yaml").write_text(TRANSPOSED_ON)
                dispatch.load_tables(tmp_path / "transposed-on.yaml")
                scope = dispatch.use_profile("transposed-on")
            else:
                scope = dispatch.use_profile()
            with scope:
                report = dispatch_model(llama, families, mode="inference")
            try:
                assert "linear" not in dict(report.model_code)
                assert any(r.family == "linear" for r in report.routed)
            finally:
                restore_model(llama)
