"""What a family tells ``dispatch_model``: which modules of a model compute it, and how
their calls reach its facade.

A family's ``ModelRecognition`` answers in two ways, either or both:

- **whole modules** - ``claims(module)`` says a module is of the family's kind (a norm,
  a linear layer; tried in the order families are declared: of the families claiming a
  module, the first that routes it serves it), and ``module(module)`` says how it is
  served: an ``Installed`` forward (set on the instance, reading the module's parameters
  on every call), the
  reason it cannot be (a ``str``, or a ``Refused`` naming another kind), or ``None``
  (nothing to do). ``layer(module)`` does the same for a module no family claims, before
  its call sites are looked at (an attention layer that computes ALiBi itself);
- **call sites** - ``sites(module, forward, model)`` finds the functions a layer's
  ``forward`` (its class's) calls by global name that compute the family, and gives a
  ``Sites``: what each of those names stands for in a copy of the forward (a router to
  the facade). Sites of several families in one forward are served by one copy.

``expected(module)`` names a module the family expected to serve (a container named
after it) and why, reported when nothing at or under it was routed for the family.
``holds_weights`` says whether the parameters of the modules it routes reach astrai (for
the report's shares); ``noun`` is what the report counts (``modules`` or ``call sites``).
``plain_row`` names the row of the family's table that computes exactly what the modules'
own code does (``nn.Linear``: torch's ``F.linear``): where every other row is out of reach
on this machine, routing could only add its cost, and ``dispatch_model`` leaves the family
to the model's own code, saying why.
"""

from __future__ import annotations

__all__ = ["Installed", "ModelRecognition", "Note", "Refused", "Sites"]

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Installed:
    """A module's forward as astrai serves it: ``forward(self, *args, **kwargs)``, set on
    the instance (holding no module, so that a copy of the model binds it to the copy),
    with the report's words for it, what was recognised and the children it covers."""

    forward: Callable[..., Any]
    detail: str = ""
    form: Any = None
    #: The direct children the installed forward no longer calls (its work covers
    #: theirs): they are not routed on their own.
    covers: tuple[str, ...] = ()
    #: ``serves(args, kwargs)``: whether a call of the module with these arguments
    #: reaches the family (a model's loss: only with labels); ``None``: every call does.
    #: Its docstring's first line says which calls do (``verify_model`` quotes it).
    serves: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None


@dataclass(frozen=True)
class Refused:
    """A module of a kind the family knows that it cannot serve: why, and the kind the
    report lists it under (the family's name unless given)."""

    reason: str
    kind: str | None = None


@dataclass(frozen=True)
class Note:
    """What a family tells the report about a layer that has none of its work to route
    (a NoPE layer computes no rotary): a note, not a module left unrouted."""

    text: str


@dataclass(frozen=True)
class Sites:
    """The call sites a family serves in one layer's forward: the globals the forward
    reads them from, what each global name stands for in the rebuilt forward, the
    report's words, and what was recognised (kept on the module's route)."""

    owner: dict[str, Any]
    replacements: Mapping[str, Any]
    detail: str
    parts: tuple[Any, ...] = ()
    #: The direct children whose work the sites serve (a convolution the forward hands
    #: to a function it calls): not routed on their own, their weights reaching astrai.
    covers: tuple[str, ...] = ()
    #: Whether the sites serve all the layer computes with its own parameters (an
    #: attention call passes the layer's sinks); ``False`` where the layer computes more
    #: with them than the sites serve (a state-space mixer whose convolution alone is
    #: routed): the report still names the layer for its own parameters.
    accounts: bool = True


Answer = Installed | Refused | str | None


@dataclass(frozen=True)
class ModelRecognition:
    """How ``dispatch_model`` finds and serves a family in a model (see the module
    docstring)."""

    claims: Callable[[nn.Module], bool] | None = None
    module: Callable[[nn.Module], Answer] | None = None
    layer: Callable[[nn.Module], Answer] | None = None
    sites: Callable[[nn.Module, Any, nn.Module],
                    tuple[Sites | None, Sequence[str | Note]]] | None = None
    expected: Callable[[nn.Module], str | None] | None = None
    holds_weights: bool = False
    noun: str = "modules"
    plain_row: str | None = None
