"""YAML text of a workload or lock document, written without PyYAML's per-value cost.

A document is plain data: mappings with string keys, lists, strings, integers, floats,
booleans and ``None``. ``dump`` lays it out the way the documents have always looked
(``yaml.dump(..., default_flow_style=None)`` with a mapping of scalars and lists of
scalars on one line, anything deeper as a block), and is byte for byte what PyYAML
writes for lines under its width. Structure is laid out here; each distinct scalar is
rendered once by PyYAML itself, in the context it appears in (a block value, a flow item,
a key), so quoting and escaping are PyYAML's. Data of any other shape (a subclass, a
tuple, a key that is not a string, a key too long for a simple key) is written by PyYAML
whole.
"""

from __future__ import annotations

__all__ = ["dump"]

from typing import Any

import yaml

_WIDTH = 4096
#: PyYAML writes a key this long or longer as an explicit ``? key`` entry.
_SIMPLE_KEY = 128


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc]
    """A mapping of scalars and lists of scalars on one line (``{shape: [2, 8],
    dtype: float32, ...}``), anything deeper as a block."""

    def represent_dict(self, value: Any) -> Any:
        node = super().represent_dict(value)
        node.flow_style = _flat(value)
        return node


_Dumper.add_representer(dict, _Dumper.represent_dict)


def _scalars_only(items: list[Any]) -> bool:
    """Whether a list holds no mapping or list (PyYAML writes it on one line)."""
    return not any(isinstance(x, dict | list) for x in items)


def _flat(value: dict[Any, Any]) -> bool:
    """Whether a mapping holds only scalars and lists of scalars (written on one line)."""
    return all(not isinstance(v, dict | list) or (isinstance(v, list) and _scalars_only(v))
               for v in value.values())


def pyyaml_dump(data: Any) -> str:
    """The document's text as PyYAML writes it (the layout ``dump`` reproduces)."""
    text: str = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=None,
                          width=_WIDTH, allow_unicode=True)
    return text


class _Unusual(Exception):
    """The data is not of the plain shape laid out here."""


_SCALARS = (str, int, float, bool, type(None))


class _Scalars:
    """Each distinct scalar's text in each context, rendered once by PyYAML."""

    def __init__(self) -> None:
        self.memo: dict[tuple[Any, ...], str] = {}

    def _text(self, context: str, value: Any) -> str:
        kind, keyed = type(value), context.endswith("key")
        if kind is int and not keyed:
            return str(value)  # PyYAML's own text for an int, in every value context
        if kind not in _SCALARS or (keyed and kind is not str):
            raise _Unusual
        # True == 1 == 1.0: keyed on the type too (and a float on its text, for nan)
        key = (context, kind, repr(value) if kind is float else value)
        got = self.memo.get(key)
        if got is None:
            got = self.memo[key] = _render(context, value)
        return got

    def value(self, value: Any, flow: bool) -> str:
        return self._text("flow" if flow else "block", value)

    def key(self, value: Any, flow: bool) -> str:
        return self._text("flow key" if flow else "block key", value)


#: How each context is shown to PyYAML, and the text around the scalar in what it writes.
_CONTEXTS: dict[str, tuple[Any, str, str]] = {
    "flow": (lambda v: [v], "[", "]\n"),
    "block": (lambda v: [v, {}], "- ", "\n- {}\n"),
    "flow key": (lambda v: [{v: 0}], "- {", ": 0}\n"),
    "block key": (lambda v: {v: [{}]}, "", ":\n- {}\n"),
}


def _render(context: str, value: Any) -> str:
    make, head, tail = _CONTEXTS[context]
    text = pyyaml_dump(make(value))
    if not (text.startswith(head) and text.endswith(tail)):
        raise _Unusual
    got = text[len(head):len(text) - len(tail)]
    if "\n" in got:  # a string PyYAML folds over lines: double-quoted on one line instead
        text = yaml.dump([value], Dumper=_Dumper, default_style='"', default_flow_style=True,
                         width=10**9, allow_unicode=True)
        got = text[1:-2]
        if not (text.startswith("[") and text.endswith("]\n")) or "\n" in got:
            raise _Unusual
    if context == "block key" and len(got) >= _SIMPLE_KEY:
        raise _Unusual
    return got


def dump(data: Any) -> str:
    """The YAML text of a document (``data`` as ``pyyaml_dump`` lays it out)."""
    if type(data) not in (dict, list):
        return pyyaml_dump(data)
    try:
        layout = _Layout()
        if layout.is_flow(data):
            return layout.flow(data) + "\n"
        if type(data) is dict:
            layout.mapping(data, "", "")
        else:
            layout.sequence(data, "", "")
        return "".join(layout.out)
    except _Unusual:
        return pyyaml_dump(data)


class _Layout:
    """Block structure: each line's indentation and what leads it."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.scalars = _Scalars()

    @staticmethod
    def is_flow(value: Any) -> bool:
        """Whether ``value`` goes on one line (a scalar, a flat mapping, a list of scalars)."""
        kind = type(value)
        if kind is dict:
            return _flat(value)
        if kind is list:
            return _scalars_only(value)
        if kind not in _SCALARS:
            raise _Unusual
        return True

    def flow(self, value: Any) -> str:
        kind = type(value)
        if kind is dict:
            key = self.scalars.key
            return "{" + ", ".join(f"{key(k, True)}: {self.flow(v)}"
                                   for k, v in value.items()) + "}"
        if kind is list:
            return "[" + ", ".join(self.flow(v) for v in value) + "]"
        return self.scalars.value(value, True)

    def inline(self, value: Any) -> str:
        """A value that goes on one line, after ``key: `` or ``- ``."""
        if type(value) in (dict, list):
            return self.flow(value)
        return self.scalars.value(value, False)

    def mapping(self, value: dict[Any, Any], indent: str, first: str) -> None:
        """A block mapping: its first line starts with ``first``, the others with
        ``indent``."""
        out, lead = self.out, first
        for k, v in value.items():
            key = self.scalars.key(k, False)
            if self.is_flow(v):
                out.append(f"{lead}{key}: {self.inline(v)}\n")
            else:
                out.append(f"{lead}{key}:\n")
                if type(v) is dict:
                    self.mapping(v, indent + "  ", indent + "  ")
                else:  # a list under a key has its dashes at the key's indentation
                    self.sequence(v, indent, indent)
            lead = indent

    def sequence(self, value: list[Any], indent: str, first: str) -> None:
        """A block sequence: its first dash after ``first``, the others after ``indent``."""
        out, lead = self.out, first
        for item in value:
            dash = f"{lead}- "
            if self.is_flow(item):
                out.append(f"{dash}{self.inline(item)}\n")
            elif type(item) is dict:
                self.mapping(item, indent + "  ", dash)
            else:
                self.sequence(item, indent + "  ", dash)
            lead = indent
