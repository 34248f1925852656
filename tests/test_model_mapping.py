"""Every model type in the installed transformers' causal-LM mapping (``tests._mapping``):
each that builds tiny on CPU and runs a plain forward is routed, and its routed copy must
give the plain model's logits and greedy tokens, pass ``verify_model`` (sites this input
does not reach named as unreached), name nothing for what it is not, and restore exactly.
A type that cannot be built, or whose plain model fails, is skipped with the reason.
``test_mapping_coverage_table`` prints the table docs/transformers.md shows
(``pytest tests/test_model_mapping.py -s``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from astrai.integrations.transformers import dispatch_model, restore_model, verify_model
from tests import _mapping, _zoo
from tests._zoo import quiet  # noqa: F401 - the fixture

TYPES = _mapping.types()


@dataclass
class Outcome:
    """What one model type did: ``why`` it was not routed, or its report."""

    why: str = ""
    report: Any = None
    unreached: int = 0


_OUTCOMES: dict[str, Outcome] = {}


pytestmark = pytest.mark.usefixtures("quiet")


def _greedy(model: nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor | str:
    try:
        return _zoo.greedy(model, feed)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _route(name: str) -> Outcome:
    """Build ``name``, route a copy, and check it against the plain model."""
    plain, why = _mapping.build(name)
    if plain is None:
        return Outcome(f"cannot be built tiny on CPU: {why}")
    feed = _zoo.inputs(plain, batch=1, seq=8)
    try:
        want = _zoo.logits(plain, feed)
    except Exception as e:
        return Outcome(f"the plain model fails: {type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0][:160]}")
    routed = copy.deepcopy(plain)
    report = dispatch_model(routed)

    # the same numbers, the same tokens (where the plain model generates)
    torch.testing.assert_close(_zoo.logits(routed, feed), want, atol=1e-4, rtol=1e-4)
    tokens = _greedy(plain, feed)
    if isinstance(tokens, torch.Tensor):
        assert torch.equal(_greedy(routed, feed), tokens)  # type: ignore[arg-type]

    # every routed site serves, or is named unreached by this input with the reason
    served = verify_model(routed, **feed)
    for site, reason in served.unreached.items():
        assert reason, site

    # nothing named for what it is not: a convolution's weight is no expert stack
    modules = dict(routed.named_modules())
    for entry in report.routed:
        module = modules.get(entry.path)
        if entry.family == "moe_experts":
            assert not isinstance(module, nn.modules.conv._ConvNd), entry.path

    # restore puts the model back exactly
    restore_model(routed)
    assert torch.equal(_zoo.logits(routed, feed), _zoo.logits(plain, feed))
    return Outcome(report=report, unreached=len(served.unreached))


@pytest.mark.parametrize("name", TYPES)
def test_routed_model_is_the_model(name: str) -> None:
    outcome = _OUTCOMES[name] = _route(name)
    if outcome.report is None:
        pytest.skip(f"{name} {outcome.why}")


def _fully_routed(report: Any) -> bool:
    return {n.family for n in report.not_routed} <= {"embedding"}


def test_mapping_coverage_table() -> None:
    """The coverage table over the whole mapping (printed): what reaches astrai in each
    type that builds, and why the others are not there."""
    rows, skipped = [], []
    for name in TYPES:
        outcome = _OUTCOMES.get(name) or _OUTCOMES.setdefault(name, _route(name))
        if outcome.report is None:
            skipped.append(f"| {name} | {outcome.why} |")
        else:
            rows.append(_zoo.coverage_row(name, outcome.report))
    routed = [o for o in (_OUTCOMES.get(n) for n in TYPES) if o and o.report is not None]
    fully = sum(_fully_routed(o.report) for o in routed)
    import transformers
    print(f"\ntransformers {transformers.__version__}: {len(TYPES)} model types in the "
          f"causal-LM mapping; {len(rows)} build tiny and run on CPU, none broken by "
          f"routing, verify_model passing on each; {fully} fully routed\n")
    print(_zoo.TABLE_HEAD + "\n" + "\n".join(rows))
    print("\n| model type | not built |\n|---|---|\n" + "\n".join(skipped))
    assert len(rows) + len(skipped) == len(TYPES)
    assert rows, "no model type of the mapping built"
