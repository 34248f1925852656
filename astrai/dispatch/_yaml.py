"""Safe YAML reading that keeps the line and column of every key and value.

Only the standard YAML tags are accepted; anything else (``!!python/object``...)
is an error, so a table can never run code. Duplicate mapping keys are errors too
(plain ``yaml.safe_load`` silently keeps the last one).
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


def load_located(text: str) -> Located:
    """Parse one YAML document; raises ``YamlProblem`` (never a yaml or other error)."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
            raise YamlProblem(line, col, f"invalid YAML: {exc.problem or exc}") from None
        except yaml.YAMLError as exc:
            raise YamlProblem(1, 1, f"invalid YAML: {exc}") from None
        out = Located(data=None)
        if node is None:
            return out
        out.data = _convert(loader, node, (), out)
        return out
    finally:
        loader.dispose()


def _convert(loader: yaml.SafeLoader, node: yaml.Node, path: Path, out: Located) -> Any:
    out.values[path] = _pos(node)
    if isinstance(node, yaml.MappingNode):
        if node.tag != _MAP_TAG:
            raise YamlProblem(*_pos(node), f"unsupported YAML tag {node.tag!r}")
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlProblem(*_pos(key_node), "mapping keys must be plain scalars")
            key = _scalar(loader, key_node)
            if key in result:
                raise YamlProblem(*_pos(key_node), f"duplicate key {key!r}")
            if isinstance(key, (list, dict)):  # pragma: no cover - excluded above
                raise YamlProblem(*_pos(key_node), "mapping keys must be plain scalars")
            out.keys[path + (key,)] = _pos(key_node)  # noqa: RUF005 (py3.10 syntax)
            result[key] = _convert(loader, value_node, (*path, key), out)
        return result
    if isinstance(node, yaml.SequenceNode):
        if node.tag != _SEQ_TAG:
            raise YamlProblem(*_pos(node), f"unsupported YAML tag {node.tag!r}")
        return [_convert(loader, item, (*path, i), out) for i, item in enumerate(node.value)]
    out.styles[path] = getattr(node, "style", None)
    return _scalar(loader, node)


def _scalar(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if node.tag not in _SAFE_SCALAR_TAGS:
        raise YamlProblem(*_pos(node), f"unsupported YAML tag {node.tag!r}")
    try:
        return loader.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, TypeError) as exc:
        raise YamlProblem(*_pos(node), f"invalid value: {exc}") from None
