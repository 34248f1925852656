"""Safe YAML reading that keeps the line and column of every key and value.

Only the standard YAML tags are accepted; anything else (``!!python/object``...)
is an error, so a table can never run code. Duplicate mapping keys are errors too
(plain ``yaml.safe_load`` silently keeps the last one). Nesting depth and the number
of values (aliases count each time they are used) are bounded, so a self-referencing
alias or an alias bomb is an error too, not a hang or a ``RecursionError``: the size the
aliases expand to is measured on the composed node graph before anything is converted
(each node once), and what aliases add beyond the document's own nodes is bounded on
its own (``MAX_ALIASED``), so a few hundred bytes cannot make millions of values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

Path = tuple[Any, ...]

_SAFE_SCALAR_TAGS = frozenset(
    "tag:yaml.org,2002:" + t for t in ("str", "int", "float", "bool", "null")
)
_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
MAX_DEPTH = 64  # a table is 4-5 levels deep
MAX_VALUES = 100_000  # a shipped table has under 100
#: The most values aliases may add to a document by being expanded (astrai writes none).
MAX_ALIASED = 100_000


@dataclass
class Located:
    """A YAML document as plain data plus the position of every node in it."""

    data: Any
    values: dict[Path, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path, tuple[int, int]] = field(default_factory=dict)
    styles: dict[Path, str | None] = field(default_factory=dict)

    def where(self, path: Path, *, key: bool = False) -> tuple[int, int]:
        """1-based ``(line, column)`` of ``path``'s key or value, or of its nearest ancestor."""
        table = self.keys if key else self.values
        p = tuple(path)
        while p:
            if p in table:
                return table[p]
            if p in self.values:
                return self.values[p]
            p = p[:-1]
        return self.values.get((), (1, 1))


class YamlProblem(Exception):
    """A YAML syntax or safety problem at a position."""

    def __init__(self, line: int, column: int, message: str) -> None:
        self.line = line
        self.column = column
        self.message = message
        super().__init__(f"{line}:{column}: {message}")


def _pos(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def load_located(text: str, max_values: int = MAX_VALUES, *, fast: bool = False) -> Located:
    """Parse one YAML document; raises ``YamlProblem`` (never a yaml or other error).
    More than ``max_values`` values (aliases counted each time used) is a problem. With
    ``fast``, the document is composed by libyaml where PyYAML has it (the same nodes and
    positions, an order of magnitude sooner: for large workload and lock files)."""
    loader: yaml.SafeLoader | None = None
    try:
        make = getattr(yaml, "CSafeLoader", yaml.SafeLoader) if fast else yaml.SafeLoader
        loader = make(text)
        node = loader.get_single_node()
        out = Located(data=None)
        if node is not None:
            _bounded(node, max_values)
            out.data = _Converter(loader, out).convert(node, ())
        return out
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise YamlProblem(line, col, f"invalid YAML: {exc.problem or exc}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        line, col = _line_col(text, exc.position)
        raise YamlProblem(line, col, f"invalid YAML: {exc.reason} "
                                     f"(character {exc.character!r})") from None
    except yaml.YAMLError as exc:
        raise YamlProblem(1, 1, f"invalid YAML: {exc}") from None
    except (ValueError, OverflowError) as exc:  # the scanner: chr() of an out-of-range \U escape
        mark = loader.get_mark() if loader is not None else None
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise YamlProblem(line, col, f"invalid YAML: {exc}") from None
    except RecursionError:  # the composer recurses once per nesting level
        raise YamlProblem(1, 1, f"YAML nested too deeply (the limit is {MAX_DEPTH} "
                                "levels)") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_data(text: str, max_values: int = MAX_VALUES) -> Any:
    """The data of one YAML document without positions: the same data, and the same
    ``YamlProblem``, as ``load_located(text, max_values, fast=True).data``, sooner and in
    a fraction of the memory (no node graph). A document this reading does not take as
    it is (a tag, an anchor, a duplicate key, a YAML error...) is read by
    ``load_located``, which says where the problem is."""
    got = _plain_data(text, max_values)
    if got is _UNUSUAL:
        return load_located(text, max_values, fast=True).data
    return got


_UNUSUAL = object()


def _plain_data(text: str, max_values: int) -> Any:
    """The document's data built from libyaml's events, or ``_UNUSUAL`` for anything but
    untagged, anchor-free mappings, sequences and scalars with unique keys."""
    from yaml.events import (
        DocumentEndEvent,
        DocumentStartEvent,
        MappingEndEvent,
        MappingStartEvent,
        ScalarEvent,
        SequenceEndEvent,
        SequenceStartEvent,
        StreamEndEvent,
        StreamStartEvent,
    )

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    plain = _PlainValues(loader)
    stack: list[Any] = []  # the open collections, innermost last
    keys: list[Any] = []  # beside each: a mapping's key awaiting its value, else _UNUSUAL
    root: Any = _UNUSUAL
    values = 1  # the root too, as load_located counts
    try:
        event = loader.get_event()
        if type(event) is not StreamStartEvent:
            return _UNUSUAL
        if type(loader.get_event()) is not DocumentStartEvent:
            return _UNUSUAL
        while True:
            event = loader.get_event()
            kind = type(event)
            if kind is ScalarEvent:
                if event.anchor is not None or event.tag not in (None, "!"):
                    return _UNUSUAL
                value: Any = event.value
                if event.tag is None and event.implicit[0]:  # plain: the resolver's type
                    value = plain.get(value, _UNUSUAL)
                    if value is _UNUSUAL:
                        value = plain.make(event.value)
                        if value is _UNUSUAL:
                            return _UNUSUAL
            elif kind is MappingStartEvent or kind is SequenceStartEvent:
                if event.anchor is not None or event.tag not in (None, "!"):
                    return _UNUSUAL
                if len(stack) >= MAX_DEPTH:
                    return _UNUSUAL
                if stack and type(stack[-1]) is dict and keys[-1] is _UNUSUAL:
                    return _UNUSUAL  # a collection as a key
                new: Any = {} if kind is MappingStartEvent else []
                stack.append(new)
                keys.append(_UNUSUAL)
                continue
            elif kind is MappingEndEvent or kind is SequenceEndEvent:
                value = stack.pop()
                keys.pop()
            elif kind is DocumentEndEvent:
                break
            else:  # an alias, or anything else
                return _UNUSUAL
            if not stack:
                root = value
                continue
            top = stack[-1]
            if type(top) is list:
                top.append(value)
            elif keys[-1] is _UNUSUAL:  # a key
                if value in top:
                    return _UNUSUAL
                keys[-1] = value
                continue
            else:
                top[keys[-1]] = value
                keys[-1] = _UNUSUAL
            values += 1
            if values > max_values:
                return _UNUSUAL
        if type(loader.get_event()) is not StreamEndEvent:
            return _UNUSUAL
        return root
    except Exception:  # any YAML error: load_located reports it, located
        return _UNUSUAL
    finally:
        loader.dispose()


class _PlainValues(dict[str, Any]):
    """The value of each distinct plain scalar, resolved and made once by the loader's own
    resolver and constructor (``_UNUSUAL`` for one it would refuse)."""

    def __init__(self, loader: Any) -> None:
        super().__init__()
        self.loader = loader

    def make(self, text: str) -> Any:
        tag: str = self.loader.resolve(yaml.ScalarNode, text, (True, False))
        made: Any = text
        if tag not in _SAFE_SCALAR_TAGS:
            made = _UNUSUAL
        elif tag != "tag:yaml.org,2002:str":
            try:
                made = self.loader.yaml_constructors[tag](self.loader, yaml.ScalarNode(tag, text))
            except Exception:
                made = _UNUSUAL
        self[text] = made
        return made


def _bounded(root: yaml.Node, max_values: int) -> None:
    """Refuse, before converting, a node graph whose aliases expand past ``max_values``
    values in all or add more than ``MAX_ALIASED`` to the document's own nodes, or that
    refers to itself (each node is sized once, so a bomb costs its own size to check)."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    unique = 0

    def size(node: yaml.Node, depth: int) -> int:
        nonlocal unique
        key = id(node)
        known = sizes.get(key)
        if known is not None:
            return known
        if key in active or depth > MAX_DEPTH:
            raise YamlProblem(*_pos(node), f"nested deeper than {MAX_DEPTH} levels (a "
                                           "self-referencing alias?)")
        active.add(key)
        unique += 1
        n = 1
        if isinstance(node, yaml.MappingNode):
            n += sum(size(v, depth + 1) for _, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n += sum(size(item, depth + 1) for item in node.value)
        active.discard(key)
        sizes[key] = n
        if n > max_values:
            raise YamlProblem(*_pos(node), f"more than {max_values} values (after "
                                           "expanding aliases): too large to read")
        if n - unique > MAX_ALIASED:
            raise YamlProblem(*_pos(node), f"aliases here expand to {n} values, more than "
                                           f"{MAX_ALIASED} beyond the document's own: refused "
                                           "(an alias bomb?)")
        return n

    size(root, 0)


def _line_col(text: str, position: int) -> tuple[int, int]:
    before = text[:position]
    return before.count("\n") + 1, position - (before.rfind("\n") + 1) + 1


class _Converter:
    """Turns the composed node graph into plain data, recording every position (its
    size and depth already bounded: ``_bounded``)."""

    def __init__(self, loader: yaml.SafeLoader, out: Located) -> None:
        self.loader = loader
        self.out = out

    def convert(self, node: yaml.Node, path: Path) -> Any:
        out = self.out
        out.values[path] = _pos(node)
        if isinstance(node, yaml.MappingNode):
            if node.tag != _MAP_TAG:
                raise YamlProblem(*_pos(node), f"unsupported YAML tag {node.tag!r}")
            result: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    raise YamlProblem(*_pos(key_node), "mapping keys must be plain scalars")
                key = _scalar(self.loader, key_node)
                if key in result:
                    raise YamlProblem(*_pos(key_node), f"duplicate key {key!r}")
                out.keys[path + (key,)] = _pos(key_node)  # noqa: RUF005 (py3.10 syntax)
                result[key] = self.convert(value_node, (*path, key))
            return result
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ_TAG:
                raise YamlProblem(*_pos(node), f"unsupported YAML tag {node.tag!r}")
            return [self.convert(item, (*path, i)) for i, item in enumerate(node.value)]
        out.styles[path] = getattr(node, "style", None)
        return _scalar(self.loader, node)


def _scalar(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if node.tag not in _SAFE_SCALAR_TAGS:
        raise YamlProblem(*_pos(node), f"unsupported YAML tag {node.tag!r}")
    try:
        return loader.construct_object(node, deep=True)
    except Exception:  # a standard tag on a value it cannot convert (KeyError, ...)
        raise YamlProblem(*_pos(node), f"invalid {node.tag.rsplit(':', 1)[-1]} value "
                                       f"{node.value!r}") from None
