"""Validated table and profile files as plain frozen dataclasses.

The pydantic models (``models``) define and validate the file formats; what the
builders (``loader``, ``profiles``) read is this plain form, made either from a
validated model's dump or from the precompiled shipped tables (``precompiled``),
which is how loading the shipped tables avoids importing pydantic at all. A test
keeps the fields here equal to the models' fields.
"""

from __future__ import annotations

__all__ = ["AxisData", "OverlayData", "ProfileData", "RowData", "TableData"]

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal


@dataclass(frozen=True)
class AxisData:
    """An extra axis a family declares (``models.AxisModel``)."""

    name: str
    type: Literal["bool", "int", "enum"]
    values: tuple[str, ...] = ()
    nullable: bool = False
    description: str = ""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AxisData:
        """From a validated ``AxisModel`` dump."""
        return cls(d["name"], d["type"], tuple(d.get("values", ())), d.get("nullable", False),
                   d.get("description", ""))


@dataclass(frozen=True)
class RowData:
    """One implementation row (``models.RowModel``)."""

    name: str
    impl: str
    when: str = "always"
    available: str | None = None
    faithful: bool = True
    description: str = ""
    requires: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RowData:
        """From a validated ``RowModel`` dump."""
        return cls(d["name"], d["impl"], d.get("when", "always"), d.get("available"),
                   d.get("faithful", True), d.get("description", ""),
                   tuple(d.get("requires", ())))


@dataclass(frozen=True)
class TableData:
    """A family's decision table (``models.TableFile``)."""

    version: int
    family: str
    fallback: str
    rows: tuple[RowData, ...]
    description: str = ""
    env_alias: str | None = None
    axes: tuple[AxisData, ...] = ()
    context: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TableData:
        """From a validated ``TableFile`` dump."""
        return cls(d["version"], d["family"], d["fallback"],
                   tuple(RowData.from_dict(r) for r in d["rows"]), d.get("description", ""),
                   d.get("env_alias"), tuple(AxisData.from_dict(a) for a in d.get("axes", ())),
                   d.get("context"))


@dataclass(frozen=True)
class OverlayData:
    """What a profile changes in one family (``models.FamilyOverlayModel``)."""

    force: str | None = None
    order: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    enable: tuple[str, ...] = ()
    when: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    fallback: str | None = None
    add: tuple[RowData, ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OverlayData:
        """From a validated ``FamilyOverlayModel`` dump."""
        return cls(d.get("force"), tuple(d.get("order", ())), tuple(d.get("disable", ())),
                   tuple(d.get("enable", ())), MappingProxyType(dict(d.get("when", {}))),
                   d.get("fallback"), tuple(RowData.from_dict(r) for r in d.get("add", ())))


@dataclass(frozen=True)
class ProfileData:
    """A profile (``models.ProfileFile``)."""

    version: int
    profile: str
    families: Mapping[str, OverlayData]
    description: str = ""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProfileData:
        """From a validated ``ProfileFile`` dump."""
        return cls(d["version"], d["profile"],
                   MappingProxyType({k: OverlayData.from_dict(v)
                                     for k, v in d["families"].items()}),
                   d.get("description", ""))
