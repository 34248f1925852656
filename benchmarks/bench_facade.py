"""Every ``astrai.ops`` facade vs the direct torch call it replaces (contract §11).

Decode sizes, CPU, 1 thread, ``torch.no_grad()``:

- ``rms_norm``  x [1, 512], weight [512]            vs ``F.rms_norm``
- ``linear``    x [1, 512], weight [512, 512]       vs ``F.linear``
- ``rotary``    x [1, 1, 8, 64], freqs [1, 1, 32, 2] vs adjacent pairs rotated by hand
  (the cheaper of two formulations, both printed: real arithmetic on the pair
  halves, and the pairs as complex numbers)
- ``attention`` q [1, 1, 8, 64], k/v [1, 128, 8, 64] (dense ``[batch, seq, heads, dim]``)
  vs ``F.scaled_dot_product_attention`` plus the layout work the facade replaces:
  transpose to ``[batch, heads, seq, dim]`` and merge the heads back.
- ``ops.call`` of a user's family (``gelu``, a table written for this run: a row for
  3-d calls and ``torch.nn.functional.gelu``) x [1, 512] vs ``F.gelu``.

For each: the direct call, the row the table chose called directly (so the cost
splits into row and dispatch), the facade, and the median over 41 rounds of paired
timings of facade / direct with an A/A control (direct / a copy of itself). The
floor lines say what no dispatch can beat: the row alone, and the facade's one
validation of the call (its ``describe``) followed by the row, with no decision at all.
Gate: what astrai adds to each call, dispatch = facade - row alone (validation, decision,
counting), <= 1.0 us, on the path in force: the compiled hot path when it is built
(``astrai-ops native --build``; the first line says whether it is loaded), else the
pure-Python one. With the compiled path loaded, the pure-Python path's dispatch is
measured in the same rounds and printed beside it (not a gate). The ratios facade /
direct are printed too, not as gates: they depend on how fast the row is, not on what
astrai adds.

``--device cuda`` puts the tensors on a CUDA device: the figures are then host time per
call (kernels queue asynchronously), which is what dispatch costs there.
"""

from __future__ import annotations

import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved_us, paired_ratios

import astrai.dispatch as d
from astrai import native, ops
from astrai.backends.rotary import rotary_freqs
from astrai.dispatch import facade
from astrai.dispatch.facade import FACADES

Fn = Callable[[], torch.Tensor]


@dataclass
class Case:
    family: str
    shape: str
    direct: Fn
    facade: Fn
    call_row: Callable[[Any], torch.Tensor]  # the chosen row called as the facade would
    full: tuple[Any, ...] | None  # the facade's full argument tuple (what its validation
    # reads); None for ops.call, whose validation is the table's own


def copy_of(fn: Fn) -> Fn:
    """The same code as a separate function object: the A/A control."""
    return types.FunctionType(fn.__code__, fn.__globals__, "copy", fn.__defaults__,
                              fn.__closure__)


def served_row(family: str, facade: Fn) -> tuple[str, Any]:
    """The row that serves ``facade()``, as the usage counters report it, and its object."""
    d.reset_stats()
    facade()
    (name,) = d.stats().by_row()[family]
    row = d.current().family(family).row(name)
    assert row is not None
    return name, row.obj


BUDGET_US = 1.0

#: ``ops.call``'s family for this run: a row its calls never reach, and gelu.
USER_TABLE = """\
version: 1
family: gelu
fallback: torch
rows:
  - name: tanh3d
    impl: torch.nn.functional:hardtanh
    when: ndim == 3
  - name: torch
    impl: torch.nn.functional:gelu
"""


def user_family() -> None:
    """Load the ``gelu`` family beside the shipped tables."""
    folder = Path(tempfile.mkdtemp(prefix="bench_facade-"))
    (folder / "gelu.yaml").write_text(USER_TABLE, encoding="utf-8")
    d.load_tables(folder / "gelu.yaml")


def python_dispatch(facade_call: Fn, row: Fn) -> float:
    """The pure-Python path's dispatch (facade - row, us): timed inside one
    ``python_path()`` block, which makes the routes' plans again on entry and on exit."""
    with facade.python_path():
        facade_call()  # the route's first call there keeps the decision with its plan
        t = interleaved_us({"row": row, "python": facade_call}, 2000)
    return t["python"] - t["row"]


def cases(device: torch.device) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 512, generator=g).to(device)
    w_norm = torch.randn(512, generator=g).to(device)
    w_lin = (torch.randn(512, 512, generator=g) / 512**0.5).to(device)
    xr = torch.randn(1, 1, 8, 64, generator=g).to(device)
    # [1, 1, 32, 2]: (cos, sin) per pair
    freqs = rotary_freqs(torch.tensor([[7]]), 64).to(device)
    b, h, s, dim = 1, 8, 128, 64
    q = torch.randn(b, 1, h, dim, generator=g).to(device)
    k = torch.randn(b, s, h, dim, generator=g).to(device)
    v = torch.randn(b, s, h, dim, generator=g).to(device)

    def rotary_pairs() -> torch.Tensor:
        pairs = xr.view(1, 1, 8, 32, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        f = freqs.unsqueeze(-3)  # a broadcast axis for the heads
        cos, sin = f[..., 0], f[..., 1]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)

    def rotary_complex() -> torch.Tensor:
        rot = torch.view_as_complex(freqs.unsqueeze(-3))
        return torch.view_as_real(torch.view_as_complex(xr.view(1, 1, 8, 32, 2)) * rot
                                  ).flatten(-2)

    t = interleaved_us({"pairs": rotary_pairs, "complex": rotary_complex}, number=2000)
    rotary = rotary_pairs if t["pairs"] <= t["complex"] else rotary_complex
    print(f"direct rotary: pairs {t['pairs']:.2f} us, complex {t['complex']:.2f} us; "
          f"baseline = {rotary.__name__}")

    def attention() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))
        return out.transpose(1, 2).reshape(b, 1, h * dim)

    return [
        Case("rms_norm", "x [1,512]", lambda: F.rms_norm(x, (512,), w_norm, 1e-6),
             lambda: ops.rms_norm(x, w_norm), lambda row: row(x, w_norm, 1e-6),
             (x, w_norm, 1e-6)),
        Case("linear", "[1,512]x[512,512]", lambda: F.linear(x, w_lin),
             lambda: ops.linear(x, w_lin), lambda row: row(x, w_lin, None),
             (x, w_lin, None)),
        Case("rotary", "x [1,1,8,64]", rotary, lambda: ops.apply_rotary(xr, freqs),
             lambda row: row(xr, freqs), (xr, freqs)),
        Case("attention", f"B{b} H{h} S{s} D{dim}", attention, lambda: ops.attention(q, k, v),
             lambda row: row(q, k, v), (q, k, v, None, 0, None, False, None, {})),
        Case("gelu", "ops.call x [1,512]", lambda: F.gelu(x), lambda: ops.call("gelu", x),
             lambda row: row(x), None),
    ]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="where the tensors live")
    device = torch.device(parser.parse_args(argv).device)
    torch.set_num_threads(1)
    print(f"machine: {torch.get_num_threads()} thread, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}; no_grad, tensors on {device}")
    hot = native.status()
    print(f"{hot}: {'gating it' if hot.loaded else 'gating the pure-Python path'}")
    user_family()
    met = True
    with torch.no_grad():
        for c in cases(device):
            name, obj = served_row(c.family, c.facade)
            torch.testing.assert_close(c.facade(), c.direct())

            def row(c: Case = c, obj: Any = obj) -> torch.Tensor:
                return c.call_row(obj)

            def floor(c: Case = c, row: Fn = row,
                      describe: Callable[..., Any] = (FACADES[c.family].call.describe
                                                      if c.full else print)
                      ) -> torch.Tensor:
                describe(*c.full or ())  # the facade's one validation of the call, then the row
                return row()

            t = interleaved_us({"direct": c.direct, "row": row, "facade": c.facade}, 2000)
            others = {"facade": c.facade, "control": copy_of(c.direct), "row": row}
            if c.full:
                others["floor"] = floor
            r = paired_ratios(c.direct, others, 2000)
            dispatch = t["facade"] - t["row"]
            ok = "PASS" if dispatch <= BUDGET_US else "FAIL"
            met &= dispatch <= BUDGET_US
            print(f"\n{c.family} {c.shape}: direct {t['direct']:.2f} us, row {name} alone "
                  f"{t['row']:.2f} us, facade {t['facade']:.2f} us")
            print(f"  row - direct {t['row'] - t['direct']:+.2f} us; dispatch (facade - row) "
                  f"{dispatch:+.2f} us  target <= {BUDGET_US:.1f} us  {ok}")
            if hot.loaded:
                print(f"  pure-Python path: dispatch {python_dispatch(c.facade, row):+.2f} us "
                      f"(printed, not the gate)")
            print(f"  A/A control (direct / a copy of direct), paired: {r['control']:.3f}x")
            print(f"  floor, paired: row alone {r['row']:.3f}x" + (
                f"; validation + row, no dispatch {r['floor']:.3f}x" if c.full else ""))
            print(f"  facade / direct, paired: {r['facade']:.3f}x (printed, not a gate)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
