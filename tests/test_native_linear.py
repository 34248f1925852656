"""The ``native`` linear row: ``x @ W.T + b`` for a few rows of float32, the weight read
once as it is stored (``astrai/native/kernels.cpp``'s ``linear_rows_kernel``).

The extension is built once per session (conftest's ``built``); without a C++ compiler
these tests skip, saying so. Where the kernel has no vector build (not x86-64-v3, or not
GCC) the row is unavailable, which one test checks either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

import astrai.dispatch as dispatch
from astrai import ops
from astrai.backends import native as rows
from tests.conftest import python_child


@pytest.fixture
def vectorised(kernels: ModuleType) -> Iterator[ModuleType]:
    """The kernels, where the linear kernel runs its vector build (else the row is
    unavailable: ``test_it_is_available_where_its_vector_build_runs``), on a machine taken
    for the AMD CPU the row was measured to win on (its table's ``when`` names it)."""
    if not kernels.linear_rows_vectorised():
        pytest.skip("the native linear kernel has no vector build for this CPU")
    with dispatch.assume_machine(cpu_vendor="amd", cpu_isa="avx512"):
        yield kernels


def _call(shape: tuple[int, ...], out_f: int, bias: bool, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    w = torch.randn(out_f, shape[-1], generator=g) / max(1, shape[-1]) ** 0.5
    b = torch.randn(out_f, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("shape", [(512,), (1, 512), (1, 1, 512), (2, 515), (3, 1, 9),
                                   (4, 64), (5, 33), (9, 7), (2, 3, 1), (1, 8)])
@pytest.mark.parametrize("out_f", [1, 7, 8, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_it_computes_f_linear(kernels: ModuleType, shape: tuple[int, ...], out_f: int,
                              bias: bool) -> None:
    """Every count of rows (groups of four and the rest), of outputs (blocks of eight and
    the rest) and of inputs (lanes of eight and the tail)."""
    x, w, b = _call(shape, out_f, bias)
    got = kernels.linear_rows_kernel(x, w, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the sums in float64, rounded once: the kernel is as close as F.linear is
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert (got.double() - exact).abs().max() <= 4 * (want.double() - exact).abs().max() + 1e-6


def test_views_are_read_through_their_strides(kernels: ModuleType) -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, 130, generator=g)
    w = base[:, 1:65]  # rows 130 apart, each contiguous
    x = torch.randn(65, 3, generator=g)[1:].t()  # not contiguous
    b = torch.randn(80, generator=g)[::2]
    torch.testing.assert_close(kernels.linear_rows_kernel(x, w, b), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5)
    broadcast = torch.randn(1, 64, generator=g).expand(3, 64)
    torch.testing.assert_close(kernels.linear_rows_kernel(broadcast, w, None),
                               F.linear(broadcast, w), rtol=1e-5, atol=1e-5)


def test_empty_calls(kernels: ModuleType) -> None:
    w, b = torch.randn(5, 0), torch.randn(5)
    assert torch.equal(kernels.linear_rows_kernel(torch.randn(2, 0), w, b), b.expand(2, 5))
    assert torch.equal(kernels.linear_rows_kernel(torch.randn(2, 0), w, None), torch.zeros(2, 5))
    assert kernels.linear_rows_kernel(torch.randn(0, 3, 4), torch.randn(5, 4), None).shape == (
        0, 3, 5)
    assert kernels.linear_rows_kernel(torch.randn(2, 4), torch.randn(0, 4), None).shape == (2, 0)


def test_the_result_does_not_depend_on_the_number_of_threads(kernels: ModuleType) -> None:
    x, w, b = _call((3, 512), 4100, True, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear_rows_kernel(x, w, b)
        torch.set_num_threads(max(2, threads))
        many = kernels.linear_rows_kernel(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("case", ["float64", "bfloat16", "mixed", "grad", "weight-columns",
                                  "meta"])
def test_calls_it_does_not_serve_are_declined(kernels: ModuleType, case: str) -> None:
    x, w, b = _call((2, 16), 8, True)
    if case == "float64":
        x, w, b = x.double(), w.double(), None
    elif case == "bfloat16":
        x, w = x.bfloat16(), w.bfloat16()
    elif case == "mixed":
        b = b.double()  # type: ignore[union-attr]
    elif case == "grad":
        w.requires_grad_(True)
    elif case == "weight-columns":
        w = torch.randn(16, 8).t()  # [8, 16], its rows not contiguous
    else:
        x, w, b = x.to("meta"), w.to("meta"), None
    with torch.enable_grad():
        assert kernels.linear_rows_kernel(x, w, b) is None


def test_malformed_calls_are_errors(kernels: ModuleType) -> None:
    x, w, _ = _call((2, 16), 8, False)
    with pytest.raises(ValueError, match="weight \\[out, in\\]"):
        kernels.linear_rows_kernel(x, torch.randn(8, 15), None)
    with pytest.raises(ValueError, match="bias \\[out\\]"):
        kernels.linear_rows_kernel(x, w, torch.randn(7))
    with pytest.raises(TypeError, match="must be a tensor"):
        kernels.linear_rows_kernel(x, "w", None)
    with pytest.raises(TypeError):
        kernels.linear_rows_kernel(x, w)


def test_the_row_hands_a_declined_call_to_f_linear_counted(kernels: ModuleType) -> None:
    x, w, b = _call((2, 16), 8, True)
    dispatch.stats(reset=True)
    got = rows.native_linear(x.double(), w.double(), b.double())  # type: ignore[union-attr]
    torch.testing.assert_close(got, F.linear(x.double(), w.double(), b.double()))  # type: ignore[union-attr]
    assert dispatch.stats().handed == {("linear", "native", "torch's operations"): 1}


def test_it_is_available_where_its_vector_build_runs(kernels: ModuleType) -> None:
    answer = rows.native_linear_available()
    if kernels.linear_rows_vectorised():
        assert answer is True
    else:
        assert "x86-64-v3" in str(answer) and "slower" in str(answer)


def test_the_table_gives_it_decode_calls(vectorised: ModuleType) -> None:
    """One to four tokens of float32 on the CPU without autograd; not five, not float64,
    not with autograd recording."""
    w = torch.randn(24, 16)
    dispatch.stats(reset=True)
    with torch.no_grad():
        for tokens in (1, 2, 4):
            ops.linear(torch.randn(1, tokens, 16), w)
        ops.linear(torch.randn(4, 16, dtype=torch.float64), w.double())
    ops.linear(torch.randn(1, 16), w)  # autograd on
    by_row = dispatch.stats().by_row()["linear"]
    assert by_row.get("native") == {"chain": 3}
    assert sum(n for r, origins in by_row.items() if r != "native"
               for n in origins.values()) == 2


def test_a_routed_llama_decodes_the_same_tokens(vectorised: ModuleType) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    from astrai.integrations.transformers import dispatch_model, restore_model

    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        dispatch_model(model)
        dispatch.stats(reset=True)
        routed = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        restore_model(model)
    assert torch.equal(plain, routed)
    assert dispatch.stats().by_row()["linear"].get("native", {}).get("chain", 0) >= 7 * 2 * 7


def test_without_the_extension_the_row_is_unavailable_with_the_reason() -> None:
    code = """
import torch, astrai.dispatch as d
from astrai import ops
from astrai.backends import linear, native
print(native.native_linear_available())
print(linear.transposed_one_row_available() is True)
x, w = torch.randn(1, 8), torch.randn(4, 8)
with torch.no_grad():
    print(d.resolve("linear", ops.context("linear", x, w)).name)
"""
    done = python_child({"ASTR_NATIVE": "off"}, code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "astrai's native extension is not loaded: ASTR_NATIVE=off"
    # the next row for one token: the copy where it was measured to win (AMD), else torch
    assert lines[2] == ("transposed_one" if lines[1] == "True" else "torch")
