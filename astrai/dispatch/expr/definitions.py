"""A table's definitions (``define:``): named sub-expressions that its rows use as atoms.

    define:
      dense: "not has_cache and ndim == 4"
      paged: "has_cache and ndim == 3 and fwd in {prefill, decode}"

A definition is an expression over the family's axes, its predicates and its other
definitions, type-checked like a row's ``when``. Each use is a *named* spec, like a
built-in predicate: printed by its name, encoded with what it stands for, and named by
``explain`` together with the clause inside it that failed. ``define`` builds a table's
definitions in three steps, none of which parses one definition inside another (so no
chain of them can exhaust the stack):

1. each definition is parsed with every definition standing for ``always``, which
   type-checks it and shows which definitions it uses;
2. a cycle (``a`` uses ``b``, ``b`` uses ``a``) is reported where it closes: at the
   name inside the definition that closes it, by parsing that one again with the name
   refused (the vocabulary maps it to the reason);
3. the others are built in dependency order, each from the ones it uses.

A definition that fails stands for ``always`` in what is returned, so its uses in rows
raise no second error while the problem itself is reported once.
"""

from __future__ import annotations

__all__ = ["MAX_DEFINITION_DEPTH", "MAX_DEFINITION_SIZE", "Defined", "define"]

from collections.abc import Mapping
from dataclasses import dataclass

from astrai.dispatch.axes import KEYWORDS, Vocabulary
from astrai.dispatch.expr._parser import MAX_DEPTH
from astrai.dispatch.expr._tokenizer import RULES
from astrai.dispatch.expr.analysis import named_parts
from astrai.dispatch.expr.spec import Spec, parse_spec
from astrai.errors import SpecSyntaxError

#: How deep a definition's spec may be, counting through the definitions it uses (one
#: expression is at most about ``2 * MAX_DEPTH`` deep), so evaluating it never nears the
#: interpreter's recursion limit.
MAX_DEFINITION_DEPTH = 2 * MAX_DEPTH
#: How many specs a definition may stand for, counting each use of a definition inside it
#: in full, so a chain of definitions that double each other cannot make evaluating (or
#: encoding) a row take forever.
MAX_DEFINITION_SIZE = 10_000

#: A definition's problem: a ``SpecSyntaxError`` placed in its text, or a message about
#: its name (placed at the name).
Problem = SpecSyntaxError | str


@dataclass(frozen=True)
class Defined:
    """A table's definitions, built against one vocabulary.

    ``vocabulary`` is the given one with the definitions added (name -> its named
    ``Spec``; one that failed stands for ``always``, and a name that clashes with another
    is left out); ``problems`` holds ``(name, problem)`` in the order given.
    """

    vocabulary: Vocabulary
    problems: tuple[tuple[str, Problem], ...] = ()


def define(texts: Mapping[str, str], vocabulary: Vocabulary) -> Defined:
    """Build the definitions ``texts`` (name -> expression, in file order) against
    ``vocabulary`` (the family's axes and predicates); every problem is kept."""
    problems: dict[str, Problem] = {}
    names = [n for n in texts if not _clash(n, vocabulary, problems)]
    standins = vocabulary.with_definitions({n: Spec.named(n, Spec.always()) for n in names})
    uses: dict[str, list[str]] = {}
    for name in names:
        try:
            uses[name] = _uses(parse_spec(texts[name], standins), set(names))
        except SpecSyntaxError as exc:
            problems[name] = exc
    for cycle in _cycles(uses):
        closing, refused = cycle[-2], cycle[-1]
        problems[closing] = _refused(texts[closing], standins, refused, cycle)
        del uses[closing]
    built = dict(standins.definitions)
    sizes: dict[int, tuple[int, int]] = {}
    for name in _dependency_order(uses):
        spec = Spec.named(name, parse_spec(texts[name], vocabulary.with_definitions(built)))
        too_big = _too_big(name, _measure(spec, sizes))
        if too_big is not None:
            problems[name] = SpecSyntaxError(too_big, texts[name], (0, len(texts[name])))
        else:
            built[name] = spec
    ordered = tuple((n, problems[n]) for n in texts if n in problems)
    return Defined(vocabulary.with_definitions(built), ordered)


def _clash(name: str, vocabulary: Vocabulary, problems: dict[str, Problem]) -> bool:
    """Whether ``name`` cannot name a definition (recorded in ``problems`` if so)."""
    own = "; a definition needs a name of its own"
    if name in KEYWORDS:
        problems[name] = f"definition name {name!r} is a keyword of the grammar{own}"
    elif name in vocabulary.axes:
        problems[name] = f"definition name {name!r} is already an axis{own}"
    elif name in vocabulary.predicates:
        problems[name] = f"definition name {name!r} is already a built-in predicate{own}"
    elif not RULES["NAME"].fullmatch(name):
        problems[name] = (f"definition name {name!r} is not a name an expression can use: "
                          f"a letter or '_' first, then letters, digits or '_'")
    else:
        return False
    return True


def _uses(spec: Spec, names: set[str]) -> list[str]:
    """The definitions among ``names`` that ``spec`` (built with stand-ins) uses, in order."""
    return [p.description for p in named_parts(spec) if p.description in names]


def _cycles(uses: Mapping[str, list[str]]) -> list[list[str]]:
    """Cycles of definitions using each other, each as ``[a, b, ..., a]``: one per cycle
    found walking the definitions in order, its last edge dropped before walking on (so
    every cycle is broken and none reported twice)."""
    edges = {name: list(used) for name, used in uses.items()}
    found: list[list[str]] = []
    done: set[str] = set()
    for start in edges:
        path: list[str] = []
        todo: list[tuple[str, int]] = [(start, 0)]
        while todo:
            name, i = todo.pop()
            if i == 0:
                if name in done:
                    continue
                path.append(name)
            targets = edges.get(name, [])
            if i < len(targets):
                todo.append((name, i + 1))
                target = targets[i]
                if target in path:
                    found.append([*path[path.index(target):], target])
                    edges[name] = []  # the closing definition is reported, not walked on
                    todo[-1] = (name, len(targets))
                elif target not in done:
                    todo.append((target, 0))
            else:
                path.pop()
                done.add(name)
    return found


def _refused(text: str, standins: Vocabulary, refused: str,
             cycle: list[str]) -> SpecSyntaxError:
    """The error for the definition ``text`` that closes ``cycle`` at ``refused``."""
    reason = (f"definition cycle: {' -> '.join(cycle)}; a definition may use other "
              f"definitions but never itself, directly or through others")
    refusing = {**standins.definitions, refused: reason}
    try:
        parse_spec(text, standins.with_definitions(refusing))
    except SpecSyntaxError as exc:
        return exc
    raise AssertionError(f"{refused!r} is used in {text!r}")  # pragma: no cover


def _dependency_order(uses: Mapping[str, list[str]]) -> list[str]:
    """The definitions in ``uses`` (which hold no cycle), each after those it uses."""
    order: list[str] = []
    placed: set[str] = set()
    for start in uses:
        todo: list[tuple[str, bool]] = [(start, False)]
        while todo:
            name, ready = todo.pop()
            if name in placed or name not in uses:
                continue
            if ready:
                placed.add(name)
                order.append(name)
                continue
            todo.append((name, True))
            todo.extend((u, False) for u in reversed(uses[name]) if u not in placed)
    return order


def _measure(spec: Spec, known: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """``(depth, size)`` of ``spec``, counting through the definitions it uses; a named
    spec's measure is kept in ``known`` (by identity: definitions share their specs), so
    each is measured once."""
    if spec.kind == "named" and id(spec) in known:
        return known[id(spec)]
    depth, size = 0, 1
    for part in spec.parts:
        d, s = _measure(part, known)
        depth, size = max(depth, d), size + s
    got = (depth + 1, size)
    if spec.kind == "named":
        known[id(spec)] = got
    return got


def _too_big(name: str, measure: tuple[int, int]) -> str | None:
    """Why the definition ``name`` of this ``(depth, size)`` is refused, if it is."""
    depth, size = measure
    if depth > MAX_DEFINITION_DEPTH:
        return (f"definition {name!r} is nested too deeply: {depth} levels through the "
                f"definitions it uses (at most {MAX_DEFINITION_DEPTH})")
    if size > MAX_DEFINITION_SIZE:
        return (f"definition {name!r} is too large: it stands for {size} clauses through "
                f"the definitions it uses (at most {MAX_DEFINITION_SIZE})")
    return None
