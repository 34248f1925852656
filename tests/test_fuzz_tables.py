"""Structural mutation fuzzing of every shipped table and profile (contract §5, §6, §12).

Each example takes the shipped set (``tables/`` and ``tables/profiles/``), mutates one or
two of its files (keys dropped, values of the wrong type, rows and references renamed,
duplicated rows and keys, bad versions, YAML tags, garbage expressions, non-mapping
documents, unicode, deep nesting, truncation, stray bytes...), writes the whole set into a
fresh directory and calls ``load_tables`` on it. Whatever the mutation:

* only ``TableError`` escapes (an ``AstraiError``; never a yaml, pydantic, OS or
  recursion error);
* every problem names an existing file and a line inside it (``file:line:col: ...``),
  and at least one problem points at a mutated file or at a file that refers into it;
* a refused load leaves the snapshot in force untouched: the same object, the same
  epoch, and the same decisions for a fixed set of calls;
* a mutation that happens to be harmless may load; then resolution still works, and
  the shipped tables are reloaded for the next example.

The inputs that first broke the loader (deep nesting, self-referencing and exponential
aliases, control characters, bad ``!!bool``/``!!int``/``!!float`` values, out-of-range
``\\U`` escapes) are among the mutations, and pinned one by one in ``TestRegressions``.

The grammar's own token-sequence fuzzing lives in ``tests/test_grammar.py``
(``test_any_token_soup_compiles_or_raises_syntax_error``); here token soup reaches the
parser through a table's ``when`` instead, so the file position of its errors is checked.

Example counts: the normal run uses ``NORMAL_EXAMPLES`` per property; the ``fuzz``-marked
variants (``ASTR_FUZZ=1``) use ``ASTR_FUZZ_EXAMPLES`` (default ``LONG_EXAMPLES``). The
number of examples actually run, and how they ended, is printed at the end of the module
("fuzz examples run: ..."); ``--hypothesis-show-statistics`` adds the mutation mix.
"""

from __future__ import annotations

import copy
import gc
import os
import re
import signal
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from astrai.dispatch import (
    CallContext,
    TableError,
    TableProblem,
    current,
    list_families,
    list_profiles,
    load_tables,
    reload_tables,
    resolve,
    shipped_tables_dir,
    use_profile,
)
from astrai.errors import AstraiError

NORMAL_EXAMPLES = 400
LONG_EXAMPLES = 10_000
FUZZ_EXAMPLES = int(os.environ.get("ASTR_FUZZ_EXAMPLES", LONG_EXAMPLES))
#: Nesting depths the mutations use: mostly shallow, sometimes past the loader's limit and
#: past the YAML composer's recursion (those examples cost ~0.5 s each, so they are rare).
DEPTHS = st.one_of(st.integers(1, 80), st.sampled_from([65, 100, 300, 1000]))

SHIPPED_DIR = shipped_tables_dir()
SHIPPED: dict[str, str] = {
    p.relative_to(SHIPPED_DIR).as_posix(): p.read_text(encoding="utf-8")
    for p in sorted(SHIPPED_DIR.rglob("*"))
    if p.suffix in (".yaml", ".yml")
}
TABLE_FILES = sorted(k for k, v in SHIPPED.items() if "family" in yaml.safe_load(v))
PROFILE_FILES = sorted(k for k in SHIPPED if k not in TABLE_FILES)

#: Examples run per test, and how they ended (printed when the module finishes).
RUNS: Counter[str] = Counter()

# -- strategies ------------------------------------------------------------------------

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True)
UNICODE = st.text(st.characters(codec="utf-8"), max_size=16)  # any code point but surrogates
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), NAMES, UNICODE,
    st.sampled_from(["fallback", "always", "*", "", "1", "yes", "~", "null", "0x1F"]),
)  # fmt: skip
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.one_of(NAMES, st.integers(), st.booleans()), inner, max_size=3),
    max_leaves=6,
)
TOKENS = [
    "and", "or", "not", "in", "always", "never", "none", "true", "false", "(", ")", "{", "}",
    ",", "==", "!=", "<", "<=", ">", ">=", "=", "!", "fwd", "dtype", "ndim", "head_dim",
    "has_cache", "has_mask", "device_cuda", "grad_enabled", "inference", "training",
    "no_grad", "mask_free", "cuda_device", "prefill", "decode", "float16", "bfloat16",
    "half", "float32", "int8", "0", "3", "-1", "64", "9" * 30, "dtpye", "bfloat61", "span",
    "@", "é", "\t", "#", ":", "'", '"', "&a", "*a", "|", ">", "- x", "\\", "%",
]  # fmt: skip
GARBAGE_WHEN = st.one_of(
    st.lists(st.sampled_from(TOKENS), max_size=14).map(" ".join),
    st.lists(st.sampled_from(TOKENS), max_size=14).map("".join),
    st.text(max_size=40),
)
TAGS = [
    "!!python/object:os.system", "!!python/object/apply:os.system", "!!python/name:os.system",
    "!!python/module:os", "!!python/object/new:builtins.dict", "!!binary", "!!set", "!!omap",
    "!!pairs", "!!timestamp", "!!merge", "!custom", "!", "!!str", "!!int", "!!float",
    "!!bool", "!!null", "!!map", "!!seq", "!<tag:yaml.org,2002:python/tuple>",
    "!<tag:yaml.org,2002:str>", "!!python/tuple", "!!python/unicode",
]  # fmt: skip
EMPTY_DOCUMENTS = [
    "", "\n", "   \n", "# only a comment\n", "---\n", "...\n", "--- ~\n", "~\n", "null\n",
    "{}\n", "[]\n", "\ufeff", "---\n---\n", "%YAML 1.1\n---\n", "'version: 1'\n",
]  # fmt: skip

Data = Any
PathT = tuple[Any, ...]


def node_paths(node: Data, prefix: PathT = ()) -> Iterator[PathT]:
    """Every path into a parsed YAML document (the root included)."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from node_paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from node_paths(value, (*prefix, i))


def get_at(root: Data, path: PathT) -> Data:
    """The node at ``path``."""
    for part in path:
        root = root[part]
    return root


def set_at(root: Data, path: PathT, value: Data) -> Data:
    """``root`` with the node at ``path`` replaced (the root itself when ``path == ()``)."""
    if not path:
        return value
    get_at(root, path[:-1])[path[-1]] = value
    return root


def nested(depth: int, leaf: Data, as_mapping: bool) -> Data:
    """``leaf`` inside ``depth`` levels of lists or single-key mappings."""
    for _ in range(depth):
        leaf = {"k": leaf} if as_mapping else [leaf]
    return leaf


def line_count(text: str) -> int:
    """Lines as the YAML reader counts them (it also breaks on \\r, \\x85, \\u2028/9)."""
    return len(re.split("\r\n|[\r\n\x85\u2028\u2029]", text))


def dump(data: Data) -> str:
    """YAML text of ``data`` (safe dumper, keys in their order)."""
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000)


# -- structural mutations (on the parsed document) -----------------------------------------

Draw = st.DataObject
Structural = Callable[[Draw, str, Data], Data]


def drop_key(draw: Draw, rel: str, data: Data) -> Data:
    """Delete one key of one mapping anywhere in the document."""
    maps = [p for p in node_paths(data) if isinstance(get_at(data, p), dict) and get_at(data, p)]
    if not maps:
        return data
    target = get_at(data, draw.draw(st.sampled_from(maps)))
    del target[draw.draw(st.sampled_from(list(target)))]
    return data


def wrong_type(draw: Draw, rel: str, data: Data) -> Data:
    """Replace one value anywhere (the root included) with a value of another type."""
    path = draw.draw(st.sampled_from(list(node_paths(data))))
    return set_at(data, path, draw.draw(VALUES))


def add_key(draw: Draw, rel: str, data: Data) -> Data:
    """Add an unknown key (or a known key in the wrong place) to one mapping."""
    maps = [p for p in node_paths(data) if isinstance(get_at(data, p), dict)]
    if not maps:
        return data
    key = draw.draw(st.one_of(NAMES, UNICODE, st.sampled_from(
        ["rows", "family", "profile", "families", "version", "when", "impl", "add"])))
    get_at(data, draw.draw(st.sampled_from(maps)))[key] = draw.draw(VALUES)
    return data


def unknown_reference(draw: Draw, rel: str, data: Data) -> Data:
    """Point a fallback or a profile's row/family reference at a name that does not exist."""
    if not isinstance(data, dict):
        return data
    name = draw.draw(st.one_of(NAMES, UNICODE))
    if rel in TABLE_FILES:
        rows = data.get("rows")
        if isinstance(rows, list) and rows and draw.draw(st.booleans()):
            row = rows[draw.draw(st.integers(0, len(rows) - 1))]
            if isinstance(row, dict):
                row["name"] = name  # the fallback, or a profile's reference, may dangle
                return data
        data["fallback"] = name
        return data
    families = data.get("families")
    if not isinstance(families, dict):
        families = data["families"] = {}
    family = draw.draw(st.sampled_from([*families, "*", "attention", "linear", name]))
    overlay = families.get(family)
    if not isinstance(overlay, dict):
        overlay = families[family] = {}
    key = draw.draw(st.sampled_from(
        ["force", "order", "disable", "enable", "when", "fallback", "add"]))
    if key in ("force", "fallback"):
        overlay[key] = name
    elif key == "when":
        overlay[key] = {name: "always"}
    elif key == "add":
        overlay[key] = [{"name": name, "impl": "tests._impls:fast"}]
    else:
        overlay[key] = [name]
    return data


def duplicate_row(draw: Draw, rel: str, data: Data) -> Data:
    """Repeat a row (the same object, so the dump uses an anchor and an alias) or a name."""
    if not isinstance(data, dict):
        return data
    if rel in TABLE_FILES:
        rows = data.get("rows")
        if not isinstance(rows, list) or not rows:
            return data
        i = draw.draw(st.integers(0, len(rows) - 1))
        how = draw.draw(st.sampled_from(["alias", "copy", "rename"]))
        if how == "alias":
            rows.insert(draw.draw(st.integers(0, len(rows))), rows[i])
        elif how == "copy":
            rows.append(copy.deepcopy(rows[i]))
        else:
            j = draw.draw(st.integers(0, len(rows) - 1))
            if isinstance(rows[j], dict) and isinstance(rows[i], dict):
                rows[j]["name"] = rows[i].get("name")
        return data
    families = data.get("families")
    if not isinstance(families, dict):
        return data
    family = draw.draw(st.sampled_from(["attention", "linear", "rotary", "rms_norm"]))
    overlay = families.setdefault(family, {})
    if isinstance(overlay, dict):
        row = {"name": draw.draw(st.sampled_from(["math", "torch", "extra", "fp8"])),
               "impl": "tests._impls:fast"}
        overlay["add"] = [row, dict(row)]
    return data


def bad_version(draw: Draw, rel: str, data: Data) -> Data:
    """A version this code does not know: another number, a string, a float, a list..."""
    if not isinstance(data, dict):
        return data
    if draw.draw(st.booleans()):
        data.pop("version", None)
    else:
        data["version"] = draw.draw(st.one_of(
            st.integers().filter(lambda v: v != 1), st.floats(), st.booleans(), st.none(),
            NAMES, st.just("1"), st.just(1.0), st.lists(st.integers(), max_size=2),
            st.just(2**70)))
    return data


def garbage_when(draw: Draw, rel: str, data: Data) -> Data:
    """Random text or token soup as a row's ``when`` (or a profile's ``when`` override)."""
    if not isinstance(data, dict):
        return data
    text = draw.draw(GARBAGE_WHEN)
    if rel in TABLE_FILES:
        rows = data.get("rows")
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            row = rows[draw.draw(st.integers(0, len(rows) - 1))]
            if isinstance(row, dict):
                row["when"] = text
        return data
    families = data.get("families")
    if isinstance(families, dict):
        family = draw.draw(st.sampled_from(["linear", "rotary", "*"]))
        row = draw.draw(st.sampled_from(["torch", "reference", "bf16"]))
        overlay = families.setdefault(family, {})
        if isinstance(overlay, dict):
            overlay["when"] = {row: text}
    return data


def not_a_mapping(draw: Draw, rel: str, data: Data) -> Data:
    """The whole document becomes a list, a scalar, or the mapping wrapped in a list."""
    return draw.draw(st.one_of(
        st.just([data]), st.lists(VALUES, max_size=3), SCALARS,
        st.just([["version", 1], ["family", "x"]])))


def unicode_text(draw: Draw, rel: str, data: Data) -> Data:
    """Replace one key or string value with arbitrary unicode."""
    text = draw.draw(UNICODE)
    strings = [p for p in node_paths(data) if p and isinstance(get_at(data, p), str)]
    keyed = [p for p in node_paths(data) if p and isinstance(get_at(data, p[:-1]), dict)]
    rename_a_key = draw.draw(st.booleans())
    if keyed and rename_a_key:
        path = draw.draw(st.sampled_from(keyed))
        parent = get_at(data, path[:-1])
        parent[text] = parent.pop(path[-1])
        return data
    if strings:
        return set_at(data, draw.draw(st.sampled_from(strings)), text)
    return data


DEEP = re.compile(r"DEEP_(\d+)_([LM])")


def deep_nesting(draw: Draw, rel: str, data: Data) -> Data:
    """Replace one value with lists or mappings nested ``DEPTHS`` deep (a placeholder here,
    written out as flow YAML by ``expand_deep`` after the dump: neither the dumper nor
    ``node_paths`` should recurse that deep)."""
    path = draw.draw(st.sampled_from(list(node_paths(data))))
    depth = draw.draw(DEPTHS)
    return set_at(data, path, f"DEEP_{depth}_{draw.draw(st.sampled_from('LM'))}")


def expand_deep(text: str) -> str:
    """Write each ``deep_nesting`` placeholder out as nested flow lists or mappings."""

    def flow(m: re.Match[str]) -> str:
        depth = int(m.group(1))
        opening, closing = ("{k: ", "}") if m.group(2) == "M" else ("[", "]")
        return opening * depth + "x" + closing * depth

    return DEEP.sub(flow, text)


def rename_owner(draw: Draw, rel: str, data: Data) -> Data:
    """Rename the family or profile: to a new name, another file's, or an invalid one."""
    if not isinstance(data, dict):
        return data
    key = "family" if rel in TABLE_FILES else "profile"
    data[key] = draw.draw(st.one_of(
        st.sampled_from(["attention", "linear", "rotary", "rms_norm", "reference",
                         "low-precision", "profile", "family"]), NAMES, UNICODE))
    if draw.draw(st.booleans()):  # and sometimes make it both a table and a profile
        data["profile" if key == "family" else "family"] = "both"
    return data


AXIS_NAMES = st.one_of(NAMES, st.sampled_from(
    ["span", "inference", "fwd", "and", "none", "always", "mode", "span"]))
AXIS_DECLARATIONS = st.fixed_dictionaries(
    {"name": AXIS_NAMES, "type": st.sampled_from(["bool", "int", "enum", "dtype", "float"])},
    optional={"values": st.lists(st.one_of(NAMES, st.sampled_from(["and", "none", "true"])),
                                 max_size=3),
              "nullable": st.booleans()},
)


def declare_axes(draw: Draw, rel: str, data: Data) -> Data:
    """Declare extra axes (well- or ill-formed) and test one of them in a row's ``when``."""
    if rel not in TABLE_FILES or not isinstance(data, dict):
        return data
    decls = draw.draw(st.lists(AXIS_DECLARATIONS, min_size=1, max_size=3))
    data["axes"] = decls
    rows = data.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        decl: dict[str, Any] = draw.draw(st.sampled_from(decls))
        name = decl["name"]
        values = [str(v) for v in decl.get("values") or ["x"]]
        rows[0]["when"] = draw.draw(st.sampled_from([
            name, f"{name} == {values[0]}", f"{name} >= 3", f"{name} in {{{', '.join(values)}}}",
            f"not {name} == none", f"{name} and ndim == 3"]))
    return data


ROW_NAMES = ["flash", "torch_native", "math", "fp8", "bf16", "torch", "reference", "complex",
             "fallback"]


def profile_overlay(draw: Draw, rel: str, data: Data) -> Data:
    """A profile overlay built from real row names (so it often loads and is resolved)."""
    if rel not in PROFILE_FILES or not isinstance(data, dict):
        return data
    families = data.get("families")
    if not isinstance(families, dict):
        families = data["families"] = {}
    family = draw.draw(st.sampled_from(["*", "attention", "linear", "rotary", "rms_norm"]))
    rows = st.sampled_from(ROW_NAMES)
    overlay = draw.draw(st.fixed_dictionaries({}, optional={
        "force": rows, "fallback": rows, "order": st.lists(rows, max_size=3),
        "disable": st.lists(rows, max_size=2), "enable": st.lists(rows, max_size=2),
        "when": st.dictionaries(rows, st.sampled_from(
            ["always", "never", "ndim == 3", "dtype == float32", "not has_mask"]), max_size=2),
        "add": st.lists(st.fixed_dictionaries(
            {"name": st.one_of(rows, NAMES), "impl": st.sampled_from(
                ["tests._impls:fast", "astrai.backends.linear:torch_linear"])},
            optional={"when": st.sampled_from(["always", "ndim == 2"]),
                      "faithful": st.booleans()}), max_size=2),
    }))
    families[family] = overlay
    return data


STRUCTURAL: dict[str, Structural] = {
    "declare_axes": declare_axes,
    "profile_overlay": profile_overlay,
    "drop_key": drop_key,
    "wrong_type": wrong_type,
    "add_key": add_key,
    "unknown_reference": unknown_reference,
    "duplicate_row": duplicate_row,
    "bad_version": bad_version,
    "garbage_when": garbage_when,
    "not_a_mapping": not_a_mapping,
    "unicode": unicode_text,
    "deep_nesting": deep_nesting,
    "rename_owner": rename_owner,
}

# -- text mutations (on the file's text or bytes) ---------------------------------------------

Textual = Callable[[Draw, bytes], bytes]
KEY_LINE = re.compile(rb"^(\s*(?:- )?[A-Za-z_\"'*][^:\n]*:)( .*)?$", re.M)


def yaml_tag(draw: Draw, text: bytes) -> bytes:
    """Put a YAML tag (``!!python/object`` and friends) in front of a value or the document."""
    tag = draw.draw(st.sampled_from(TAGS)).encode()
    lines = [m for m in KEY_LINE.finditer(text) if m.group(2)]
    if not lines or draw.draw(st.integers(0, 5)) == 0:
        return b"--- " + tag + b"\n" + text
    m = draw.draw(st.sampled_from(lines))
    return text[:m.end(1)] + b" " + tag + text[m.end(1):]


def duplicate_key_line(draw: Draw, text: bytes) -> bytes:
    """Repeat a ``key: value`` line right after itself (a duplicate mapping key)."""
    lines = list(KEY_LINE.finditer(text))
    if not lines:
        return text
    m = draw.draw(st.sampled_from(lines))
    line = m.group(0)
    repeated = line.replace(b"- ", b"  ", 1) if line.lstrip().startswith(b"- ") else line
    return text[:m.end()] + b"\n" + repeated + text[m.end():]


def raw_when(draw: Draw, text: bytes) -> bytes:
    """Replace a ``when:`` value with garbage written raw (the YAML may break too)."""
    lines = [m for m in re.finditer(rb"^(\s*when:)(.*)$", text, re.M)]
    if not lines:
        return text
    m = draw.draw(st.sampled_from(lines))
    garbage = draw.draw(GARBAGE_WHEN).encode("utf-8", "surrogatepass")
    return text[:m.end(1)] + b" " + garbage + text[m.end():]


def empty_document(draw: Draw, text: bytes) -> bytes:
    """An empty file, or one with only whitespace, comments, markers or an empty node."""
    return draw.draw(st.sampled_from(EMPTY_DOCUMENTS)).encode()


def truncate(draw: Draw, text: bytes) -> bytes:
    """Cut the file short anywhere (possibly inside a multi-byte character)."""
    return text[:draw.draw(st.integers(0, len(text)))]


def splice_text(draw: Draw, text: bytes) -> bytes:
    """Insert random text (any code point) anywhere."""
    at = draw.draw(st.integers(0, len(text)))
    return text[:at] + draw.draw(st.text(max_size=12)).encode("utf-8", "surrogatepass") + text[at:]


def splice_bytes(draw: Draw, text: bytes) -> bytes:
    """Insert or overwrite random bytes (often not UTF-8) anywhere."""
    at = draw.draw(st.integers(0, len(text)))
    junk = draw.draw(st.binary(min_size=1, max_size=8))
    cut = at + len(junk) if draw.draw(st.booleans()) else at
    return text[:at] + junk + text[cut:]


def line_endings(draw: Draw, text: bytes) -> bytes:
    """CRLF or CR line ends, tab indentation, a byte-order mark, or a missing final newline."""
    how = draw.draw(st.sampled_from(["crlf", "cr", "tabs", "bom", "strip", "nel"]))
    if how == "crlf":
        return text.replace(b"\n", b"\r\n")
    if how == "cr":
        return text.replace(b"\n", b"\r")
    if how == "tabs":
        return text.replace(b"  ", b"\t")
    if how == "bom":
        return "\ufeff".encode() + text
    if how == "nel":
        return text.replace(b"\n", "\u2028".encode())
    return text.rstrip()


def alias(draw: Draw, text: bytes) -> bytes:
    """Replace a value with a self-referencing alias, or add an alias bomb (the same list
    repeated ``fanout`` times per level, ``levels`` deep) under a new key."""
    lines = [m for m in KEY_LINE.finditer(text) if m.group(2)]
    recursive = draw.draw(st.booleans())
    if lines and recursive:
        m = draw.draw(st.sampled_from(lines))
        value = draw.draw(st.sampled_from([b"&r [*r]", b"&r {k: *r}", b"&r [x, [*r]]"]))
        return text[:m.end(1)] + b" " + value + text[m.end():]
    levels = draw.draw(st.integers(1, 9))
    fanout = draw.draw(st.integers(2, 9))
    bomb = [b"b0: &b0 [" + b", ".join([b"x"] * fanout) + b"]"]
    bomb += [b"b%d: &b%d [" % (i, i) + b", ".join([b"*b%d" % (i - 1)] * fanout) + b"]"
             for i in range(1, levels + 1)]
    return text.rstrip(b"\n") + b"\n" + b"\n".join(bomb) + b"\n"


TEXTUAL: dict[str, Textual] = {
    "alias": alias,
    "yaml_tag": yaml_tag,
    "duplicate_key_line": duplicate_key_line,
    "raw_when": raw_when,
    "empty_document": empty_document,
    "truncate": truncate,
    "splice_text": splice_text,
    "splice_bytes": splice_bytes,
    "line_endings": line_endings,
}


def mutate(draw: Draw, rel: str) -> bytes:
    """One shipped file after one to four structural and/or text mutations."""
    data = yaml.safe_load(SHIPPED[rel])
    n_struct = draw.draw(st.integers(0, 3))
    n_text = draw.draw(st.integers(0 if n_struct else 1, 2 if n_struct < 3 else 1))
    for _ in range(n_struct):
        name = draw.draw(st.sampled_from(sorted(STRUCTURAL)))
        event(f"mutation: {name}")
        data = STRUCTURAL[name](draw, rel, data)
    text = (expand_deep(dump(data)) if n_struct else SHIPPED[rel]).encode()
    for _ in range(n_text):
        name = draw.draw(st.sampled_from(sorted(TEXTUAL)))
        event(f"mutation: {name}")
        text = TEXTUAL[name](draw, text)
    return text


# -- the property ------------------------------------------------------------------------------

#: Calls whose decisions must not change when a load is refused.
SAMPLE_CALLS = [
    CallContext("attention", dtype=torch.float32, ndim=4, head_dim=64),
    CallContext("attention", fwd="decode", dtype=torch.float16, ndim=3, head_dim=64,
                has_cache=True),
    CallContext("rotary", dtype=torch.float32, ndim=4, head_dim=64),
    CallContext("rotary", dtype=torch.bfloat16, ndim=3, head_dim=64),
    CallContext("rms_norm", dtype=torch.float32, ndim=2),
    CallContext("linear", dtype=torch.float32, ndim=2),
]


def observe() -> tuple[Any, ...]:
    """The tables' visible state: families, profiles, and decisions under each profile."""
    seen: list[Any] = [tuple(list_families()), tuple(list_profiles())]
    for profiles in ((), ("reference",), ("low-precision",)):
        with use_profile(*profiles):
            for call in SAMPLE_CALLS:
                res = resolve(call.family, call)
                seen.append((profiles, call.family, res.name, res.origin, res.record.source))
    return tuple(seen)


def write_set(root: Path, mutated: dict[str, bytes]) -> dict[str, bytes]:
    """Write the shipped set under ``root`` with ``mutated`` files replaced; path -> bytes."""
    written: dict[str, bytes] = {}
    for rel, text in SHIPPED.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        content = mutated.get(rel, text.encode())
        path.write_bytes(content)
        written[str(path)] = content
    return written


def check_problem(problem: TableProblem, files: dict[str, bytes]) -> None:
    """A problem names one of ``files`` and a line and column inside it."""
    assert isinstance(problem, TableProblem)
    assert problem.file in files, f"{problem} names no file of the load"
    content = files[problem.file]
    try:
        lines = line_count(content.decode("utf-8"))
    except UnicodeDecodeError:
        lines = 1
    assert 1 <= problem.line <= lines, f"{problem}: line outside 1..{lines}"
    assert problem.column >= 1, f"{problem}: column < 1"
    assert problem.message.strip(), f"{problem}: empty message"
    assert str(problem).startswith(f"{problem.file}:{problem.line}:{problem.column}: ")


def check_load(mutated: dict[str, bytes], test: str) -> str:
    """Load the mutated set and check the properties of the module docstring."""
    before = current()
    epoch = before.epoch
    sample = observe()
    # Profiles loaded earlier (from the shipped files) may be reported, at line 1, when the
    # new tables break them.
    known = {str(SHIPPED_DIR / rel): text.encode() for rel, text in SHIPPED.items()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        written = write_set(root, mutated)
        changed = {str(root / rel) for rel in mutated}
        try:
            defined = load_tables(root)
        except AstraiError as exc:
            assert isinstance(exc, TableError), f"{type(exc).__name__} escaped: {exc}"
            assert exc.problems, "a TableError without problems"
            for problem in exc.problems:
                check_problem(problem, {**known, **written})
            assert any(p.file in changed or "/profiles/" in p.file or p.file in known
                       or any(c in p.message for c in changed) for p in exc.problems), (
                f"no problem points at a mutated file {sorted(changed)}: {exc}")
            assert current() is before, "a refused load replaced the snapshot"
            assert current().epoch == epoch
            assert observe() == sample, "a refused load changed a decision"
            RUNS[f"{test}: refused"] += 1
            return "refused"
    # A harmless mutation loaded: the engine still answers (under every profile too), then
    # the shipped set returns.
    assert set(defined) <= set(list_families())
    for profile in [None, *list_profiles()]:
        with use_profile(*([profile] if profile else [])):
            for call in SAMPLE_CALLS:
                try:
                    resolve(call.family, call)
                except AstraiError:
                    pass  # e.g. a fallback moved to an unavailable row: an error of our own
    reload_tables()
    RUNS[f"{test}: loaded"] += 1
    return "loaded"


@st.composite
def mutated_sets(draw: st.DrawFn) -> dict[str, bytes]:
    """One or two shipped files, mutated (everything else is written unchanged)."""
    data = draw(st.data())
    targets = draw(st.lists(st.sampled_from(sorted(SHIPPED)), min_size=1, max_size=2,
                            unique=True))
    return {rel: mutate(data, rel) for rel in targets}


FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print how many fuzz examples ran (and how they ended) when the module is done."""
    yield
    plugins = request.config.pluginmanager
    reporter = plugins.get_plugin("terminalreporter")
    capture = plugins.get_plugin("capturemanager")
    if not RUNS or reporter is None:
        return
    total = sum(RUNS.values())
    detail = ", ".join(f"{k}={v}" for k, v in sorted(RUNS.items()))
    with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
        reporter.write_line(f"\nfuzz examples run: {total} ({detail})")


class TestMutatedShippedTables:
    """``load_tables`` on the shipped set with random mutations: errors of our own only."""

    def test_every_shipped_file_is_fuzzed(self) -> None:
        """The fuzzed set is every table and profile that ships, and it loads unmutated."""
        assert TABLE_FILES and PROFILE_FILES
        assert {"attention.yaml", "linear.yaml", "rms_norm.yaml", "rotary.yaml"} <= set(
            TABLE_FILES)
        assert all(rel.startswith("profiles/") for rel in PROFILE_FILES)
        assert check_load({}, "unmutated") == "loaded"

    @settings(FUZZ, max_examples=NORMAL_EXAMPLES)
    @given(mutated=mutated_sets())
    def test_mutations(self, mutated: dict[str, bytes]) -> None:
        """Any mutation of one or two files: a located TableError or a load, nothing else;
        a refused load changes nothing."""
        event(check_load(mutated, "test_mutations"))

    @pytest.mark.parametrize("rel", sorted(SHIPPED))
    @settings(FUZZ, max_examples=max(10, NORMAL_EXAMPLES // 10))
    @given(data=st.data())
    def test_each_file(self, rel: str, data: st.DataObject) -> None:
        """Every shipped file, mutated on its own, keeps the same properties."""
        event(check_load({rel: mutate(data, rel)}, f"test_each_file[{rel}]"))

    @pytest.mark.fuzz
    @settings(FUZZ, max_examples=FUZZ_EXAMPLES)
    @given(mutated=mutated_sets())
    def test_mutations_long(self, mutated: dict[str, bytes]) -> None:
        """The long run of ``test_mutations`` (ASTR_FUZZ=1; ASTR_FUZZ_EXAMPLES examples)."""
        event(check_load(mutated, "test_mutations_long"))


class TestTargetedMutations:
    """One example of each mutation family the fuzzer draws from, checked deterministically."""

    @pytest.mark.parametrize("text", EMPTY_DOCUMENTS)
    def test_empty_or_blank_file(self, text: str) -> None:
        """An empty, blank or comment-only table file is refused at line 1."""
        assert check_load({"rotary.yaml": text.encode()}, "targeted") == "refused"

    @pytest.mark.parametrize("tag", TAGS)
    def test_yaml_tags(self, tag: str) -> None:
        """A tag on a value is refused (or, for ``!!str``, harmless)."""
        text = SHIPPED["linear.yaml"].replace("fallback: torch", f"fallback: {tag} torch")
        check_load({"linear.yaml": text.encode()}, "targeted")

    def test_python_object_tag_runs_nothing(self, tmp_path: Path) -> None:
        """``!!python/object/apply`` is refused without running the call it names."""
        marker = tmp_path / "ran"
        text = SHIPPED["rotary.yaml"].replace(
            "fallback: reference",
            f"fallback: !!python/object/apply:pathlib.Path.touch [!!python/object/apply:"
            f"pathlib.Path [{str(marker)!r}]]")
        assert check_load({"rotary.yaml": text.encode()}, "targeted") == "refused"
        assert not marker.exists()

    def test_duplicate_top_level_key_text(self) -> None:
        """``version:`` written twice is a duplicate-key problem at the second one."""
        text = SHIPPED["rms_norm.yaml"].replace("version: 1\n", "version: 1\nversion: 1\n")
        assert check_load({"rms_norm.yaml": text.encode()}, "targeted") == "refused"

    def test_non_utf8_file(self) -> None:
        """A file that is not UTF-8 is refused at line 1."""
        text = SHIPPED["attention.yaml"].encode() + b"\xff\xfe\x80"
        assert check_load({"attention.yaml": text}, "targeted") == "refused"

    @pytest.mark.parametrize("as_mapping", [False, True], ids=["lists", "mappings"])
    def test_moderate_nesting(self, as_mapping: bool) -> None:
        """A value nested 60 levels deep (within the loader's limit) is a type problem."""
        data = yaml.safe_load(SHIPPED["rotary.yaml"])
        data["fallback"] = nested(60, "x", as_mapping)
        assert check_load({"rotary.yaml": dump(data).encode()}, "targeted") == "refused"

    def test_row_renamed_breaks_profile(self) -> None:
        """Renaming a row a shipped profile enables is reported in the profile's file."""
        text = SHIPPED["linear.yaml"].replace("name: bf16", "name: bf16x")
        assert check_load({"linear.yaml": text.encode()}, "targeted") == "refused"


# -- regressions -------------------------------------------------------------------------------


def _nesting_text(depth: int, as_mapping: bool) -> bytes:
    opening, closing = ("{k: ", "}") if as_mapping else ("[", "]")
    value = opening * depth + "x" + closing * depth
    return SHIPPED["rotary.yaml"].replace("fallback: reference", f"fallback: {value}").encode()


class _Timeout(Exception):
    """Raised by the alarm in ``test_alias_expansion_is_bounded``."""


class TestRegressions:
    """Inputs that made ``load_tables`` raise something else than ``TableError``, or hang
    (found by this module); each must now be a located TableError."""

    @pytest.mark.parametrize("escape", ["\\U00110000", "\\UFFFFFFFF"])
    def test_out_of_range_unicode_escape_is_a_table_error(self, escape: str) -> None:
        """``"\\U00110000"`` (no such code point) is a located TableError (it escaped as
        ValueError / OverflowError from yaml's scanner)."""
        text = SHIPPED["rotary.yaml"].replace("fallback: reference", f'fallback: "{escape}"')
        assert check_load({"rotary.yaml": text.encode()}, "regression") == "refused"

    @pytest.mark.parametrize("depth", [1000, 50_000])
    @pytest.mark.parametrize("as_mapping", [False, True], ids=["lists", "mappings"])
    def test_deep_nesting_is_a_table_error(self, as_mapping: bool, depth: int) -> None:
        """A value nested far past the YAML composer's recursion is refused (it raised
        RecursionError)."""
        content = _nesting_text(depth, as_mapping)
        assert check_load({"rotary.yaml": content}, "regression") == "refused"

    @pytest.mark.parametrize("value", ["&a [*a]", "&a {k: *a}", "&a [[x, *a]]"])
    def test_recursive_alias_is_a_table_error(self, value: str) -> None:
        """A list or mapping that contains itself is refused (it raised RecursionError)."""
        text = SHIPPED["rotary.yaml"].replace("fallback: reference", f"fallback: {value}")
        assert check_load({"rotary.yaml": text.encode()}, "regression") == "refused"

    @pytest.mark.parametrize("char", ["\x00", "\x1f", "\x7f", "\ufffe"], ids=repr)
    def test_control_character_is_a_table_error(self, char: str) -> None:
        """A character YAML does not allow in a stream is a located TableError (it escaped
        as yaml.reader.ReaderError)."""
        text = SHIPPED["rotary.yaml"].replace("fallback: reference", f"fallback: ref{char}")
        assert check_load({"rotary.yaml": text.encode()}, "regression") == "refused"

    @pytest.mark.parametrize("value", ["!!bool 1", "!!bool maybe", "!!int ''", "!!int '-'",
                                       "!!int '+'", "!!float ''"])
    def test_bad_tagged_scalar_is_a_table_error(self, value: str) -> None:
        """A standard tag whose value does not convert is a located TableError (it escaped
        as KeyError or IndexError)."""
        text = SHIPPED["rotary.yaml"].replace("fallback: reference", f"fallback: {value}")
        assert check_load({"rotary.yaml": text.encode()}, "regression") == "refused"

    @pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
    def test_alias_expansion_is_bounded(self) -> None:
        """Nine levels of nine-fold aliases (9**9 values from ~400 bytes) are refused
        promptly (they expanded for hours). The 2 s alarm guards against an exponential
        expansion; it is not a benchmark (the refusal takes ~0.3 s)."""
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
        text = "version: 1\nfamily: bomb\nfallback: ref\n" + "\n".join(lines) + (
            "\nrows:\n  - name: ref\n    impl: tests._impls:ref\n")

        def alarm(signum: int, frame: Any) -> None:
            raise _Timeout("load_tables still expanding aliases after 2 s")

        previous = signal.signal(signal.SIGALRM, alarm)
        gc.disable()  # an alarm inside a gc callback would be swallowed
        try:
            # Repeat every 0.1 s: an alarm that lands in a destructor is swallowed.
            signal.setitimer(signal.ITIMER_REAL, 2.0, 0.1)
            try:
                outcome = check_load({"rotary.yaml": text.encode()}, "regression")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            gc.enable()
            signal.signal(signal.SIGALRM, previous)
        assert outcome == "refused"
