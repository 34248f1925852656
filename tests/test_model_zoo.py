"""The model zoo: ``dispatch_model`` on a tiny random model of every architecture users
run that the installed transformers has (``tests._zoo``), each compared with an
untouched copy of itself: logits within float32 tolerance, greedy tokens identical,
``verify_model`` passing, ``restore_model`` exact, and a report that accounts for every
module holding a weight and every norm. ``test_coverage_table`` prints the table
docs/transformers.md shows (``pytest -s``)."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from astrai.families.activation.model import is_activation_kind
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model
from astrai.recognition.inspection import is_norm_kind
from tests import _zoo
from tests._zoo import quiet  # noqa: F401 - the fixture

NAMES = [n for n in _zoo.ZOO if _zoo.available(n)]
_REPORTS: dict[str, Any] = {}


pytestmark = pytest.mark.usefixtures("quiet")


def test_the_zoo_is_large() -> None:
    """At least 25 architectures of the list are in the installed transformers (20 in a
    transformers 4, which has fewer of them)."""
    import transformers
    major = int(transformers.__version__.split(".")[0])
    assert len(NAMES) >= (25 if major >= 5 else 20), NAMES


@pytest.mark.parametrize("name", NAMES)
def test_dispatched_model_is_the_model(name: str) -> None:
    plain = _zoo.build(name)
    routed = copy.deepcopy(plain)
    report = dispatch_model(routed)
    _REPORTS[name] = report
    feed = _zoo.inputs(plain)

    # the same numbers, the same tokens
    torch.testing.assert_close(_zoo.logits(routed, feed), _zoo.logits(plain, feed),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(_zoo.greedy(routed, feed), _zoo.greedy(plain, feed))

    # every routed forward names the parameters its class's does (generate and the
    # Trainer decide what to pass by reading the model's forward)
    for (path, mine), theirs in zip(routed.named_modules(), plain.modules(), strict=True):
        if "_astrai_route" in mine.__dict__:
            assert inspect.signature(mine.forward) == inspect.signature(theirs.forward), path

    # every module routed serves a call through a row
    labels = feed.get("decoder_input_ids", feed["input_ids"]).contiguous()
    labelled = {**feed, "labels": labels}
    counts = verify_model(routed, **labelled)  # the loss too
    assert counts["linear"] > 0 and min(counts.values()) > 0

    # the report accounts for every weight and every norm
    # (a module whose parameters are all a routed module's - tied - reaches astrai there)
    named = {r.path for r in report.routed} | {n.path for n in report.not_routed}
    tied = {id(p) for m in routed.modules() if "_astrai_route" in m.__dict__
            for p in m._parameters.values()}
    for path, module in routed.named_modules():
        own = [p for p in module._parameters.values() if p is not None]
        holds = bool(own) and (isinstance(module, torch.nn.Embedding)
                               or not all(id(p) in tied for p in own))
        if (holds or is_norm_kind(module)) and "_astrai_route" not in module.__dict__:
            assert (path or "(the model)") in named, f"{path} ({type(module).__name__})"
    # every weight, norm and activation reaches astrai (transformers 5: nothing is left
    # but embedding lookups) - routed, or covered by a routed parent that no longer calls it
    import transformers
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert {n.family for n in report.not_routed} <= {"embedding"}, report.not_routed
        for path, module in routed.named_modules():
            if is_activation_kind(module) and "_astrai_route" not in module.__dict__:
                parent, _, child = path.rpartition(".")
                owner = routed.get_submodule(parent).__dict__.get("_astrai_route")
                assert owner is not None and child in owner.covers, path
    got, total = report.parameters
    assert 0 < got <= total == sum(p.numel() for p in routed.parameters())  # each once
    assert 0 < report.matmul_flops[0] <= report.matmul_flops[1]

    # restore puts the model back exactly
    assert restore_model(routed) > 0
    assert not [m for m in routed.modules() if "forward" in m.__dict__]
    assert torch.equal(_zoo.logits(routed, feed), _zoo.logits(plain, feed))


def test_coverage_table() -> None:
    """The table of what reaches astrai in each architecture (printed)."""
    rows = []
    for name in NAMES:
        report = _REPORTS.get(name) or dispatch_model(_zoo.build(name))
        rows.append(_zoo.coverage_row(name, report))
    print("\n" + _zoo.TABLE_HEAD + "\n" + "\n".join(rows))
    assert len(rows) == len(NAMES)
