"""Plan agreement across the ranks of a ``torch.distributed`` job (SPEC §12).

``check_agreement(contexts)`` resolves the given calls on this rank exactly as
``resolve`` would (tables, active profiles, ``ASTR_OPS``, ``op_backend`` scope),
all-gathers a fingerprint of the result over the process group, and raises
``PlanMismatchError`` on every rank when the ranks would not run the same rows.
With ``consensus=True`` a family whose rows differ is instead pinned, on every
rank, to the first row in table order that every rank can run for every one of
that family's calls; apply it with ``with plan.apply(): ...``.

Without an initialized process group the check runs as a world of one rank, so
a script may call it unconditionally.

A rank that cannot compute its own plan (a bad argument, broken tables on that node,
any other exception) still takes part in the collective: it sends its error instead of
a fingerprint, and every rank raises the same ``PlanMismatchError`` naming it, instead
of leaving the others waiting for the process group's timeout. ``timeout=`` bounds the
wait for the other ranks (a rank that never calls ``check_agreement``).

The fingerprints travel as JSON text in ``uint8`` tensors (``all_gather`` of the lengths,
then of the padded bytes): no pickle, so no rank unpickles another's bytes, and no NumPy,
which ``all_gather_object`` needs and a plain ``pip install torch`` does not install.
"""

from __future__ import annotations

__all__ = [
    "AgreedPlan",
    "CallPlan",
    "Fingerprint",
    "PlanDifference",
    "all_gather_bytes",
    "call_key",
    "check_agreement",
    "describe_failure",
    "differences",
    "fingerprint",
    "table_revision",
]

import dataclasses
import hashlib
import json
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from astrai import __version__
from astrai.dispatch._environ import LOCK_KEY, environ_get
from astrai.dispatch.axes import CallContext, call_key
from astrai.dispatch.plugins import in_use
from astrai.dispatch.registry import current
from astrai.dispatch.resolution import MATCH, evaluate, row_verdict, settle
from astrai.dispatch.sources import active_profiles, env_settings, op_backend
from astrai.dispatch.tables.model import table_revision
from astrai.errors import PlanMismatchError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: Shape of the gathered payload; ranks whose payloads differ in shape cannot be compared.
WIRE_FORMAT = 2
NOT_LOADED = "(not loaded)"
NOT_CHECKED = "(not checked)"
_EMPTY: Mapping[str, str] = MappingProxyType({})
#: At most this much of a rank's error text travels in its payload.
_MAX_ERROR_TEXT = 8000

Contexts = Mapping[str, CallContext] | Iterable[CallContext]


# -- this rank's fingerprint -------------------------------------------------------

@dataclass(frozen=True)
class CallPlan:
    """One call on one rank: the row it resolves to (or the error), and the rows it could use.

    ``candidates`` are the rows, in table order, that the implicit chain accepts for
    the call on this rank (available, faithful or enabled, not disabled, ``when``
    matches): what consensus chooses from.
    """

    key: str
    family: str
    row: str | None
    origin: str | None
    error: str | None
    candidates: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fingerprint:
    """What one rank would run: plain data, identical on ranks that agree (but ``host``).

    ``tables`` maps each family the calls name to its revision (``table_revision``),
    ``profiles`` lists the active profiles with their file revisions, ``calls`` the
    decision per call, ``lock`` the decision lock in force (digest and mode).
    ``orders`` (rows in effective order) and ``unavailable`` (``(family, row,
    reason)``) explain and settle differences. ``plugins`` are the installed plugins
    (``astrai.dispatch.plugins``) whose rows the checked families hold, as
    ``(distribution, version)``: ranks with different plugin versions are told apart
    (the families' revisions differ too; this names the cause).
    """

    version: str
    host: str
    tables: tuple[tuple[str, str], ...]
    profiles: tuple[tuple[str, str], ...]
    calls: tuple[CallPlan, ...]
    orders: tuple[tuple[str, tuple[str, ...]], ...] = ()
    unavailable: tuple[tuple[str, str, str], ...] = ()
    lock: str = ""  # the decision lock in force (ASTR_LOCK): its digest and mode, or ""
    plugins: tuple[tuple[str, str], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """Builtins only (JSON-ready), so a rank with another astrai version can read it."""
        return {"wire": WIRE_FORMAT, "version": self.version,
                "fingerprint": dataclasses.asdict(self)}

    @classmethod
    def from_wire(cls, data: Any) -> Fingerprint | None:
        """The fingerprint in a gathered payload, or ``None`` if its format is not ours.

        Sequences may arrive as lists (JSON has no tuples): the result is built of tuples,
        so it equals the sender's own fingerprint. Any other shape or type is ``None``.
        """
        try:
            if not isinstance(data, Mapping) or data["wire"] != WIRE_FORMAT:
                return None
            fields = data["fingerprint"]
            if not isinstance(fields, Mapping) or set(fields) != _FINGERPRINT_FIELDS:
                return None
            orders = [_seq(o, 2) for o in _seq(fields["orders"])]
            return cls(
                version=_text(fields["version"]),
                host=_text(fields["host"]),
                tables=tuple(_pair(t) for t in _seq(fields["tables"])),
                profiles=tuple(_pair(p) for p in _seq(fields["profiles"])),
                calls=tuple(_call_plan(c) for c in _seq(fields["calls"])),
                orders=tuple((_text(family), _texts(rows)) for family, rows in orders),
                unavailable=tuple(_triple(u) for u in _seq(fields["unavailable"])),
                lock=_text(fields["lock"]),
                plugins=tuple(_pair(p) for p in _seq(fields["plugins"])),
            )
        except (KeyError, TypeError, ValueError):
            return None


_FINGERPRINT_FIELDS = frozenset(f.name for f in dataclasses.fields(Fingerprint))
_CALL_FIELDS = frozenset(f.name for f in dataclasses.fields(CallPlan))


def _seq(value: Any, length: int | None = None) -> tuple[Any, ...]:
    """A list or tuple from the wire as a tuple (of ``length`` items, if given)."""
    if not isinstance(value, list | tuple) or (length is not None and len(value) != length):
        raise TypeError(f"expected a sequence of {length or 'any number of'} items")
    return tuple(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _texts(value: Any) -> tuple[str, ...]:
    return tuple(_text(v) for v in _seq(value))


def _pair(value: Any) -> tuple[str, str]:
    first, second = _seq(value, 2)
    return _text(first), _text(second)


def _triple(value: Any) -> tuple[str, str, str]:
    first, second, third = _seq(value, 3)
    return _text(first), _text(second), _text(third)


def _optional_text(value: Any) -> str | None:
    return None if value is None else _text(value)


def _call_plan(data: Any) -> CallPlan:
    if not isinstance(data, Mapping) or set(data) != _CALL_FIELDS:
        raise TypeError("not a CallPlan")
    return CallPlan(_text(data["key"]), _text(data["family"]), _optional_text(data["row"]),
                    _optional_text(data["origin"]), _optional_text(data["error"]),
                    _texts(data["candidates"]))


def _contexts(contexts: Contexts) -> dict[str, CallContext]:
    if isinstance(contexts, Mapping):
        for family, ctx in contexts.items():
            if isinstance(ctx, CallContext) and ctx.family != family:
                raise ValueError(f"contexts[{family!r}] is a context for {ctx.family!r}")
        found = list(contexts.values())
    else:
        found = list(contexts)
    unique: dict[str, CallContext] = {}
    for ctx in found:
        if not isinstance(ctx, CallContext):
            raise TypeError(f"expected CallContext objects, got {type(ctx).__name__}: {ctx!r}")
        unique.setdefault(call_key(ctx), ctx)
    return unique


def _local(contexts: Contexts) -> tuple[Fingerprint, dict[str, Exception]]:
    calls = _contexts(contexts)
    state = current()
    names = active_profiles(state, env_settings(state.families, state.profiles, state.aliases,
                                                state.epoch))
    tables: dict[str, str] = {}
    orders: dict[str, tuple[str, ...]] = {}
    unavailable: list[tuple[str, str, str]] = []
    plans: list[CallPlan] = []
    errors: dict[str, Exception] = {}
    for key, ctx in sorted(calls.items()):
        family = ctx.family
        table = state.families.get(family)
        if family not in tables:
            tables[family] = NOT_LOADED if table is None else table_revision(table)
            if table is not None:
                view = state.view(family, names)
                orders[family] = tuple(view.row_names())
                for rec in view.rows:
                    ok, reason = state.availability(rec)
                    if not ok:
                        unavailable.append((family, rec.name, reason))
        try:  # never leave before the collective: a failure is data like any decision
            res = settle(state, family, None, ctx, evaluate(family, ctx, state=state),
                         enforce=False)[0]  # a pinning lock's row is the one that runs
            view = state.view(family, names)
            candidates = tuple(r.name for r in view.rows
                               if row_verdict(state, view, r, ctx)[0] == MATCH)
        except Exception as exc:
            errors[key] = exc
            plans.append(CallPlan(key, family, None, None, f"{type(exc).__name__}: {exc}"))
            continue
        plans.append(CallPlan(key, family, res.name, res.origin, None, candidates))
    profiles = tuple((n, state.profiles[n].revision) for n in names)
    plugins = tuple(in_use(state.plugins, (state.families[f] for f in tables
                                           if f in state.families)).items())
    return Fingerprint(__version__, socket.gethostname(), tuple(sorted(tables.items())),
                       profiles, tuple(plans), tuple(sorted(orders.items())),
                       tuple(unavailable), _lock_digest(), plugins), errors


def _lock_digest() -> str:
    """The decision lock in force (``ASTR_LOCK``): its digest and mode, or ``""``."""
    if environ_get(LOCK_KEY) is None:
        return ""
    from astrai.dispatch.lockfile import lock_in_force  # deferred: only with a lock in force

    active = lock_in_force()
    return "" if active is None else active.digest


def fingerprint(contexts: Contexts) -> Fingerprint:
    """This rank's fingerprint for ``contexts`` (no communication)."""
    return _local(contexts)[0]


# -- comparing fingerprints ----------------------------------------------------------

def _rank_list(ranks: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run))
                    for run in runs)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}"


@dataclass(frozen=True)
class PlanDifference:
    """One item on which ranks differ, with the ranks holding each value.

    ``kind``: ``table`` (a family's revision), ``plugins`` (the plugins whose rows the
    checked families hold, with their versions), ``profiles`` (the active profiles),
    ``lock`` (the decision lock in force, ``ASTR_LOCK``: its digest and mode),
    ``row`` (ranks resolve a call to different rows; consensus can settle it),
    ``call`` (a call failed, or was not checked, on some ranks), ``consensus`` (no row
    of a family that every rank can run for all its calls; values are candidate rows),
    ``format`` (a rank sent a fingerprint this version cannot read), ``failed`` (ranks
    that could not compute a plan at all; the value is their error), ``timeout`` and
    ``collective`` (this rank's wait for the others timed out, or the collective itself
    failed; the value says how, for this rank alone).
    """

    kind: str
    item: str
    values: tuple[tuple[str, tuple[int, ...]], ...]
    notes: tuple[str, ...] = ()

    def ranks_of(self, value: str) -> tuple[int, ...]:
        """The ranks that hold ``value`` (empty if none)."""
        return next((ranks for v, ranks in self.values if v == value), ())

    def __str__(self) -> str:
        if self.kind == "failed":
            lines = [f"{_rank_list(ranks)} could not compute "
                     f"{'its' if len(ranks) == 1 else 'their'} plan: {value}"
                     for value, ranks in self.values]
            return "\n".join([*lines, *(f"    {n}" for n in self.notes)])
        shown = "; ".join(f"{_rank_list(ranks)} -> {value}" for value, ranks in self.values)
        label = {
            "table": f"table {self.item}",
            "profiles": "active profiles",
            "plugins": "plugins (astrai.tables entry points) in the checked families",
            "consensus": f"{self.item}: no row every rank can run for all its {self.item} "
                         "calls (rows each rank can run)",
            "format": "fingerprint format",
            "lock": "decision lock (ASTR_LOCK digest and mode)",
        }.get(self.kind, self.item)
        return "\n".join([f"{label}: {shown}", *(f"    {n}" for n in self.notes)])


def _groups(values: Sequence[str], ranks: Sequence[int]) -> tuple[tuple[str, tuple[int, ...]],
                                                                   ...]:
    out: dict[str, list[int]] = {}
    for value, rank in zip(values, ranks, strict=True):
        out.setdefault(value, []).append(rank)
    return tuple((v, tuple(rs)) for v, rs in out.items())


def _profile_values(prints: Sequence[Fingerprint]) -> list[str]:
    names = [" + ".join(n for n, _ in p.profiles) or "(none)" for p in prints]
    full = [" + ".join(f"{n}@{rev}" for n, rev in p.profiles) or "(none)" for p in prints]
    return names if len(set(names)) == len(set(full)) else full


def _unavailable_notes(prints: Sequence[Fingerprint], ranks: Sequence[int], family: str,
                       rows: set[str]) -> tuple[str, ...]:
    notes = []
    for p, rank in zip(prints, ranks, strict=True):
        for fam, row, reason in p.unavailable:
            if fam == family and row in rows:
                notes.append(f"rank {rank} ({p.host}): {row} is unavailable ({reason})")
    return tuple(notes)


def differences(prints: Sequence[Fingerprint], ranks: Sequence[int]) -> list[PlanDifference]:
    """Every item on which the fingerprints (one per rank, in ``ranks`` order) differ."""
    diffs: list[PlanDifference] = []
    tables = [dict(p.tables) for p in prints]
    for family in sorted(set().union(*tables)):
        groups = _groups([t.get(family, NOT_CHECKED) for t in tables], ranks)
        if len(groups) > 1:
            diffs.append(PlanDifference("table", family,
                                        tuple((v if v.startswith("(") else f"revision {v}", rs)
                                              for v, rs in groups)))
    groups = _groups([", ".join(f"{d} {v}" for d, v in p.plugins) or "(none)" for p in prints],
                     ranks)
    if len(groups) > 1:
        diffs.insert(0, PlanDifference("plugins", "plugins", groups))
    groups = _groups([p.lock or "(none)" for p in prints], ranks)
    if len(groups) > 1:
        diffs.append(PlanDifference("lock", "lock", groups))
    groups = _groups(_profile_values(prints), ranks)
    if len(groups) > 1:
        diffs.append(PlanDifference("profiles", "profiles", groups))
    calls = [{c.key: c for c in p.calls} for p in prints]
    for key in sorted(set().union(*calls)):
        got = [c.get(key) for c in calls]
        values = [NOT_CHECKED if c is None else c.row if c.row is not None else f"error: {c.error}"
                  for c in got]
        groups = _groups(values, ranks)
        if len(groups) == 1:
            continue
        if any(c is None or c.row is None for c in got):
            diffs.append(PlanDifference("call", key, groups))
            continue
        family = next(c.family for c in got if c is not None)
        notes = _unavailable_notes(prints, ranks, family, set(values))
        diffs.append(PlanDifference("row", key, groups, notes))
    return diffs


def _failure(diffs: Sequence[PlanDifference], n: int, extra: str = "", *,
             head: str = "") -> PlanMismatchError:
    head = head or (f"the {n} ranks of the process group would not run the same dispatch "
                    f"plan{extra}:")
    return PlanMismatchError("\n".join([head, *(f"  {d}" for d in diffs)]), diffs)


def _consensus(prints: Sequence[Fingerprint], ranks: Sequence[int],
               diffs: Sequence[PlanDifference]) -> dict[str, str]:
    """Per family with a ``row`` difference, the first row every rank can run for all of
    that family's calls; raises when some family has none."""
    family_of = {c.key: c.family for c in prints[0].calls}
    families = list(dict.fromkeys(family_of[d.item] for d in diffs))
    pinned: dict[str, str] = {}
    stuck: list[PlanDifference] = []
    for family in families:
        order = dict(prints[0].orders).get(family, ())
        usable = []
        for p in prints:
            sets = [set(c.candidates) for c in p.calls if c.family == family]
            usable.append(tuple(r for r in order if all(r in s for s in sets)))
        common = [r for r in order if all(r in u for u in usable)]
        if common:
            pinned[family] = common[0]
        else:
            stuck.append(PlanDifference("consensus", family, _groups(
                [", ".join(u) or "(none)" for u in usable], ranks)))
    if stuck:
        raise _failure([*diffs, *stuck], len(ranks), ", and consensus found no common row")
    return pinned


# -- the result and the collective -------------------------------------------------------

@dataclass(frozen=True)
class AgreedPlan:
    """What every rank of the group runs for the checked calls.

    ``rows`` maps each call's label (``call_key``) to its row; ``overrides`` maps a
    family to the row consensus pinned (empty when the ranks already agreed). The pin
    takes effect only within ``with plan.apply():``.
    """

    ranks: tuple[int, ...]
    rank: int
    fingerprint: Fingerprint
    rows: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    overrides: Mapping[str, str] = field(default_factory=lambda: _EMPTY)

    @property
    def world_size(self) -> int:
        """How many ranks took part."""
        return len(self.ranks)

    @property
    def digest(self) -> str:
        """A short hash of the agreed plan (tables, profiles, rows), equal on every rank."""
        text = json.dumps([self.fingerprint.tables, self.fingerprint.profiles,
                           sorted(self.rows.items())])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def apply(self) -> AbstractContextManager[None]:
        """``op_backend(**overrides)``: the consensus rows, strictly, within the block."""
        return op_backend(**self.overrides)

    def summary(self) -> str:
        """Lines for a log: the digest, the profiles, and each call's row."""
        profiles = " + ".join(n for n, _ in self.fingerprint.profiles) or "(none)"
        lines = [f"astrai plan {self.digest} agreed by {self.world_size} rank(s); "
                 f"profiles: {profiles}"]
        family_of = {c.key: c.family for c in self.fingerprint.calls}
        for key, row in sorted(self.rows.items()):
            pinned = " (consensus)" if family_of.get(key) in self.overrides else ""
            lines.append(f"  {key} -> {row}{pinned}")
        return "\n".join(lines)


def _encode(payload: dict[str, Any]) -> bytes:
    """The payload as JSON (ASCII: anything else, lone surrogates too, is escaped)."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode("ascii")


def _decode(data: bytes) -> Any:
    """What a rank sent, or ``None`` when it is not JSON (e.g. another version's pickle)."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def describe_failure(exc: BaseException) -> str:
    """``"TypeError: message"`` for a payload (bounded; never raises)."""
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not keep this rank from the collective
        text = "(the error's message could not be formatted)"
    if len(text) > _MAX_ERROR_TEXT:
        text = text[:_MAX_ERROR_TEXT] + " [...]"
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def _failed_payload(exc: BaseException) -> dict[str, Any]:
    """What a rank sends instead of a fingerprint when it could not compute one."""
    try:
        host = socket.gethostname()
    except Exception:
        host = "?"
    return {"wire": WIRE_FORMAT, "version": __version__, "host": host,
            "failed": describe_failure(exc)}


def _failed_text(data: Any) -> str | None:
    """The error in a failed rank's payload, or ``None`` when the payload is not one."""
    if (isinstance(data, Mapping) and data.get("wire") == WIRE_FORMAT
            and isinstance(data.get("failed"), str)):
        return str(data["failed"])
    return None


def _seconds(timeout: float | timedelta | None) -> float | None:
    """``timeout=`` in seconds (``None``: the process group's own timeout)."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"check_agreement: timeout must be seconds (a number) or a "
                        f"datetime.timedelta, got {type(timeout).__name__}: {timeout!r}")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"check_agreement: timeout must be a positive, finite number of "
                         f"seconds, got {timeout!r}")
    return seconds


def _device(group: ProcessGroup | None) -> torch.device:
    """Where the group's collectives take their tensors: NCCL's on this rank's CUDA device."""
    import torch.distributed as dist  # deferred: ~60 ms, needed only here

    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None,
                what: str, start: float, timeout: float | None) -> None:
    """``dist.all_gather``, waited for until ``timeout`` seconds after ``start`` at most;
    a timeout or a failure of the collective raises ``PlanMismatchError`` saying which
    all-gather it was and after how long (the backend's error is its ``__cause__``)."""
    import torch.distributed as dist  # deferred: ~60 ms, needed only here

    timed_out = False
    try:
        work = dist.all_gather(out, tensor, group=group, async_op=True)
        if timeout is None:
            work.wait()
        else:
            left = max(start + timeout - time.monotonic(), 0.001)
            timed_out = work.wait(timeout=timedelta(seconds=left)) is False
    except RuntimeError as exc:  # torch.distributed's errors (DistError and the backends')
        elapsed = time.monotonic() - start
        if timeout is not None and elapsed >= timeout - 0.05:  # clocks differ a little
            raise _collective_error("timeout", what, elapsed, timeout, group) from exc
        raise _collective_error("collective", what, elapsed, timeout, group, exc) from exc
    if timed_out:
        raise _collective_error("timeout", what, time.monotonic() - start, timeout, group)


def _collective_error(kind: str, what: str, elapsed: float, timeout: float | None,
                      group: ProcessGroup | None,
                      exc: BaseException | None = None) -> PlanMismatchError:
    import torch.distributed as dist  # deferred: ~60 ms, needed only here

    rank, n = dist.get_rank(), dist.get_world_size(group)
    where = f"rank {rank} (of a group of {n})"
    if kind == "timeout":
        value = f"timed out after {elapsed:.1f} s (timeout={timeout:g} s)"
        message = (f"check_agreement timed out on {where} after {elapsed:.1f} s "
                   f"(timeout={timeout:g} s) waiting for the other ranks in the all-gather "
                   f"of the {what}: some rank of the group has not called check_agreement. "
                   f"The process group cannot be used after this: destroy it, or exit")
    else:
        value = f"failed after {elapsed:.1f} s: {describe_failure(exc) if exc else '?'}"
        message = (f"check_agreement: the all-gather of the {what} failed on {where} after "
                   f"{elapsed:.1f} s (a rank may have exited or lost its connection): "
                   f"{describe_failure(exc) if exc else '?'}")
    diff = PlanDifference(kind, f"all-gather of the {what}", ((value, (rank,)),))
    return PlanMismatchError(message, [diff])


def all_gather_bytes(data: bytes, n: int, group: ProcessGroup | None,
                      timeout: float | None = None) -> list[bytes]:
    """Every rank's ``data``, in group order: the lengths first, then the bytes padded to
    the longest (two ``all_gather`` calls on plain tensors; neither pickle nor NumPy).
    Both together wait at most ``timeout`` seconds (``None``: the group's own timeout)."""
    start = time.monotonic()
    device = _device(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    _all_gather(lengths, length, group, "payload lengths", start, timeout)
    sizes = [int(t.item()) for t in lengths]
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    buffers = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    _all_gather(buffers, mine, group, "payloads", start, timeout)
    return [bytes(buf[:size].cpu().tolist()) for buf, size in zip(buffers, sizes, strict=True)]


def _gather(payload: dict[str, Any], group: ProcessGroup | None, timeout: float | None = None
            ) -> tuple[list[Any], tuple[int, ...], int]:
    import torch.distributed as dist  # deferred: ~60 ms, needed only here

    if not (dist.is_available() and dist.is_initialized()):
        return [_decode(_encode(payload))], (0,), 0
    index = dist.get_rank(group)
    if index < 0:
        raise ValueError("check_agreement: this process is not a member of the given group")
    n = dist.get_world_size(group)
    gathered = [_decode(raw) for raw in all_gather_bytes(_encode(payload), n, group, timeout)]
    ranks = tuple(range(n)) if group is None else tuple(dist.get_process_group_ranks(group))
    return gathered, ranks, index


def _unusable(gathered: Sequence[Any], prints: Sequence[Fingerprint | None],
              ranks: Sequence[int]) -> PlanMismatchError | None:
    """The error every rank raises when some rank sent an error or an unreadable payload
    instead of a fingerprint (``None`` when all are fingerprints)."""
    failed = [_failed_text(g) for g in gathered]
    if not any(f is not None for f in failed) and all(p is not None for p in prints):
        return None
    n = len(ranks)
    diffs: list[PlanDifference] = []
    for text, group_ranks in _groups([f or "" for f in failed], ranks):
        if not text:
            continue
        hosts = [str(g.get("host", "?")) for g, f in zip(gathered, failed, strict=True)
                 if f == text]
        notes = tuple(f"rank {r} runs on {h}" for r, h in zip(group_ranks, hosts, strict=True))
        diffs.append(PlanDifference("failed", "plan", ((text, group_ranks),), notes))
    unreadable = [p is None and f is None for p, f in zip(prints, failed, strict=True)]
    if any(unreadable):
        versions = [str(g.get("version", "?")) if isinstance(g, dict) else "?" for g in gathered]
        values = [f"{'unreadable' if bad else 'readable'} (astrai {v})"
                  for bad, v in zip(unreadable, versions, strict=True)]
        diffs.append(PlanDifference("format", "format", _groups(values, ranks)))
    count = sum(f is not None for f in failed)
    if not count:
        return _failure(diffs, n)
    head = (f"{count} of the {n} ranks of the process group could not compute a dispatch "
            f"plan, so the plans cannot be compared:")
    return _failure(diffs, n, head=head)


def check_agreement(contexts: Contexts, group: ProcessGroup | None = None, *,
                    consensus: bool = False,
                    timeout: float | timedelta | None = None) -> AgreedPlan:
    """Check that every rank of ``group`` (default: the whole job) would run the same rows.

    ``contexts`` is ``{family: CallContext}`` or any iterable of contexts (several per
    family allowed, e.g. prefill and decode). Each rank resolves them as ``resolve``
    would there, and a fingerprint (table revisions, active profiles, the row per
    call) is all-gathered; a collective, so call it on every rank of the group. Raises
    ``PlanMismatchError`` on every rank when they differ. With ``consensus=True``, rows
    that differ are settled instead: each such family gets the first row, in table
    order, that every rank can run for all its calls (``AgreedPlan.overrides``; apply
    with ``with plan.apply():``). Differing tables or profiles, a call that fails on
    some rank, or a family without a common row still raise. A call that fails alike
    on every rank re-raises its error. Without a process group this is a world of one.
    With NCCL, set each rank's CUDA device first (the gathered tensors live on
    ``torch.cuda.current_device()``).

    A rank that cannot compute its plan at all (``contexts`` holds something that is
    not a ``CallContext``, its tables fail to load, any other ``Exception``) still joins
    the all-gather, sending its error instead of a fingerprint; every rank then raises
    the same ``PlanMismatchError``, e.g. ``rank 1 could not compute its plan:
    TableError: ...`` (on the failing rank with its own error as ``__cause__``), rather
    than the other ranks waiting for the process group's timeout. When every rank fails
    with the same error, each re-raises its own error instead.

    ``timeout`` (seconds, or a ``datetime.timedelta``; default ``None``: the process
    group's own timeout, 30 minutes unless set) bounds how long this rank waits for the
    others in the all-gather (a rank that never calls ``check_agreement``, or calls it
    much later). When it passes, this rank raises ``PlanMismatchError`` naming the
    all-gather and the time waited; the collective is left pending, so the process
    group is not usable after that (destroy it, or exit). The other ranks need not pass
    the same ``timeout``. The collectives are issued with ``async_op=True`` and waited
    for with the backend's ``Work.wait(timeout)`` (tested with gloo; with NCCL, the first
    collective of a group also creates its communicator, a wait that this timeout may
    not bound). An error of the collective itself (say a rank exited) raises
    ``PlanMismatchError`` too, with the backend's error as ``__cause__``.
    """
    local_error: Exception | None = None
    seconds: float | None = None
    mine: Fingerprint | None = None
    errors: dict[str, Exception] = {}
    try:  # never leave before the collective: this rank's failure is data for the others
        seconds = _seconds(timeout)
        mine, errors = _local(contexts)
        payload = mine.to_wire()
    except Exception as failure:
        local_error, mine = failure, None
        payload = _failed_payload(failure)
    gathered, ranks, index = _gather(payload, group, seconds)
    prints = [Fingerprint.from_wire(g) for g in gathered]
    if local_error is not None and all(_failed_text(g) == payload["failed"] for g in gathered):
        raise local_error  # the same failure on every rank: the caller's own error is clearer
    problem = _unusable(gathered, prints, ranks)
    if problem is not None:
        raise problem from local_error
    assert mine is not None  # local_error is None, else _unusable reported this rank
    readable = [p for p in prints if p is not None]
    diffs = differences(readable, ranks)
    pinned: dict[str, str] = {}
    if diffs:
        if not consensus:
            raise _failure(diffs, len(ranks))
        if any(d.kind != "row" for d in diffs):
            raise _failure(diffs, len(ranks), ", and consensus cannot settle differing tables, "
                                              "profiles, plugins or failed calls")
        pinned = _consensus(readable, ranks, diffs)
    for exc in errors.values():
        raise exc  # the same failure on every rank: the caller's own error is clearer
    rows = {c.key: pinned.get(c.family, c.row) for c in mine.calls if c.row is not None}
    return AgreedPlan(ranks, ranks[index], mine, MappingProxyType(rows),
                      MappingProxyType(pinned))
