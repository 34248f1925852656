"""The fast reading and writing of workload and lock documents give exactly what the
careful paths give: the same text as PyYAML's layout, the same data, the same located
problems."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astrai.dispatch.tables._yaml import (
    _UNUSUAL,
    YamlProblem,
    _plain_data,
    load_data,
    load_located,
)
from astrai.formats.yaml_text import dump, pyyaml_dump

TRICKY = ["yes", "null", "1.0", "a, b", "- x", "#c", "a: b", "", " s", "~", "0x1f",
          "2001-12-14", "'q'", '"', "é", "<<", "=", "1:30", "0o17", ".inf", "{x}", "[",
          "a\nb", "\x85", "\u2028", "tab\there", "\\"]
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
           | st.text(max_size=12) | st.sampled_from(TRICKY))
KEYS = st.text(max_size=10) | st.sampled_from(["shape", "z", "k", "yes", "1", "?x", ":",
                                               "a b", "<<", "- k"])
DATA = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(KEYS, inner, max_size=4), max_leaves=25)
DOCUMENTS = st.dictionaries(KEYS, DATA, max_size=5) | st.lists(DATA, max_size=4)
#: What a hand edit or a hostile file may add: anchors, aliases, tags, broken syntax.
JUNK = ["", "&a ", "*a", "!!str ", "!!python/object:os.system ", "!!timestamp ", "\t",
        "- ", "{", "]", ": ", "? ", "\n- x\n", "---\n", "...\n", "x: 1\nx: 2\n",
        "%YAML 1.1\n---\n", "!!map ", "<<: {a: 1}\n"]
EXAMPLES = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


def _breaks(data: object) -> bool:
    """Whether a string in ``data`` holds a character PyYAML may fold a line at."""
    return any(ch in repr(data) for ch in ("\\n", "\\x85", "\\u2028", "\\u2029", "\\r"))


@EXAMPLES
@given(DOCUMENTS)
def test_the_text_is_pyyaml_s_layout(data: object) -> None:
    ours = dump(data)
    assert yaml.safe_load(ours) == yaml.safe_load(pyyaml_dump(data))
    if not _breaks(data):
        assert ours == pyyaml_dump(data)


def test_a_string_pyyaml_folds_is_kept_on_one_line() -> None:
    data = {"calls": [{"object": "a\nb\u2028c " * 3, "n": 1}, {"k": [{"x": "\x85"}]}]}
    text = dump(data)
    assert yaml.safe_load(text) == data
    assert len(text.splitlines()) == 4


def test_data_of_another_shape_is_written_by_pyyaml() -> None:
    for data in ({"t": (1, 2)}, {1: "x"}, {"k" * 200: {"a": [{}]}}, {"s": True, "f": 1.5}):
        assert dump(data) == pyyaml_dump(data)


def _outcome(read: object, text: str) -> tuple[object, ...]:
    try:
        return ("data", repr(read(text)))  # type: ignore[operator]
    except YamlProblem as exc:
        return ("problem", exc.line, exc.column, exc.message)


@EXAMPLES
@given(DOCUMENTS, st.randoms(), st.sampled_from(JUNK))
def test_reading_without_positions_gives_what_reading_with_them_gives(
        data: object, rnd: random.Random, junk: str) -> None:
    text = dump(data)
    if rnd.random() < 0.6:
        at = rnd.randrange(len(text) + 1)
        text = text[:at] + junk + text[at:]
    assert _outcome(lambda t: load_data(t, 50), text) == \
        _outcome(lambda t: load_located(t, 50, fast=True).data, text)


def test_what_the_fast_reading_leaves_to_the_located_one() -> None:
    for text in ("a: &x 1\nb: *x\n", "a: !!str 1\n", "a: 1\na: 2\n", "? [1]\n: 2\n",
                 "a: 2001-12-14\n", "---\na: 1\n---\nb: 2\n", "", "a: [1, 2\n",
                 "[" * 70 + "]" * 70):
        assert _plain_data(text, 1000) is _UNUSUAL, text
    assert _plain_data("a: [1, 2.5, yes, ~, '1', x]\n", 1000) == \
        {"a": [1, 2.5, True, None, "1", "x"]}
    assert _plain_data("[1, 2, 3]", 3) is _UNUSUAL  # four values with the list
    assert _plain_data("[1, 2, 3]", 4) == [1, 2, 3]


def test_a_problem_in_a_large_file_is_still_located(tmp_path: Path) -> None:
    from astrai.errors import FileFormatError
    from astrai.record.workload import RecordedCall, TensorArg, Workload

    calls = [RecordedCall("rms_norm", {"tokens": i + 1}, (TensorArg((i + 1, 8), "float32",
                                                                   "cpu"),), {}, 1)
             for i in range(500)]
    path = Workload.of(calls).save(tmp_path / "wl.yaml")
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "shape: [400, 8]" in line)
    lines[at] = lines[at].replace("float32", "float33")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FileFormatError) as err:
        Workload.load(path)
    (problem,) = err.value.problems
    assert problem.line == at + 1
    assert "float33" in problem.message
    assert lines[at][problem.column - 1:].startswith("float33")
