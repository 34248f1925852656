"""The table and profile file formats (schema version 1): the only definition of them.

The pydantic models here validate every file that takes the full path (``load``),
including each row's ``when``, which is parsed against the file's vocabulary (the
design's "pydantic-validated grammar"; see ``When``). What a valid file yields is
the model's ``model_dump(mode="json")``: ``load`` builds the engine objects from
that dump, and the precompiled artifact (``artifact``) stores that same dump, so the
fast path reads this one format without importing pydantic. The JSON Schemas under
``schemas/`` are generated from these models (``astrai.formats.schemas``; ``astrai-ops
schema --check`` fails when the checked-in files drift).
"""

from __future__ import annotations

__all__ = [
    "SUPPORTED_VERSION",
    "AxisModel",
    "Definitions",
    "FamilyOverlayModel",
    "MeasuredModel",
    "NoiseModel",
    "OverlayFile",
    "OverlayRowModel",
    "ProfileFile",
    "ProvenanceModel",
    "RowModel",
    "TableFile",
    "json_schemas",
    "schemas_dir",
]

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    model_validator,
)

from astrai.dispatch.axes import AXES, FEATURE_AXES, MACHINE_AXES
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.names import NAME_PATTERN, family_name_problem
from astrai.dispatch.tables.artifact import schemas_dir
from astrai.dispatch.tables.parts import FileModel, MachineModel

SUPPORTED_VERSION = 1

Name = Annotated[
    StrictStr,
    Field(pattern=NAME_PATTERN, description="a row, family or profile name"),
]


def _family_name(name: str) -> str:
    problem = family_name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


FamilyName = Annotated[Name, AfterValidator(_family_name)]
ImportPath = Annotated[
    StrictStr,
    Field(
        pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$",
        description="'module.path:attribute' (exactly one ':')",
    ),
]
ModuleName = Annotated[
    StrictStr,
    Field(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$", description="an importable module name"),
]


def _parse_when(text: str, info: ValidationInfo) -> str:
    """Parse a row's expression with the file's vocabulary (``context["vocabulary"]``,
    built from the table's ``axes:``). A ``SpecSyntaxError`` is a ``ValueError``: the
    validation error carries it, and the loader renders it with its file position.
    Without a vocabulary (a profile's rows: their family is only known when the
    profile is built) the expression is parsed then."""
    vocabulary = (info.context or {}).get("vocabulary")
    if vocabulary is not None:
        Spec.parse(text, vocabulary)
    return text


def _expression_help() -> str:
    base = [f"{n} ({a.kind})" for n, a in AXES.items() if not a.lazy]
    lazy = [f"{n} ({a.kind})" for n, a in AXES.items() if a.lazy]
    return ("a spec expression (contract §4): axes compared with constants (or an int axis with "
            "another), joined by and / or / not. Built-in axes: " + ", ".join(base) +
            "; shape and hardware axes, read off a call only when some table compares them, "
            "a length keyed by its interval between the constants it is compared with: "
            + ", ".join(lazy) + "; machine axes, read once per process: "
            + ", ".join(f"{n} ({a.kind})" for n, a in MACHINE_AXES.items())
            + "; plus the family's own axes (axes:)")


Expression = Annotated[StrictStr, Field(min_length=1, description=_expression_help())]
When = Annotated[Expression, AfterValidator(_parse_when)]
DefinitionName = Annotated[
    StrictStr,
    Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
          description="a name rows use as an atom: not an axis, a predicate or a keyword"),
]
#: A table's ``define:``: name -> expression (checked as a whole by ``build``).
Definitions = dict[DefinitionName, Expression]


Feature = Literal[FEATURE_AXES]  # type: ignore[valid-type]




class AxisModel(FileModel):
    """An extra axis a family declares; its value travels in ``CallContext.extra``."""

    name: Name
    type: Literal["bool", "int", "enum"]
    values: list[Name] = Field(default_factory=list, description="allowed names (enum only)")
    nullable: StrictBool = False
    description: StrictStr = ""


class RowModel(FileModel):
    """One implementation row."""

    name: Name
    impl: ImportPath = Field(description="the implementation object, bound at load time")
    when: When = Field(default="always",
                       description=f"which calls this row can serve; {_expression_help()}")
    available: ImportPath | None = Field(
        default=None, description="zero-argument probe: can this row run on this machine?"
    )
    faithful: StrictBool = Field(
        default=True, description="false: changes numerics; never picked implicitly"
    )
    explicit_only: StrictBool = Field(
        default=False,
        description="true: picked by name only (backend=, op_backend, ASTR_OPS, a profile's "
                    "force) or when a profile enables it; never by the implicit chain",
    )
    description: StrictStr = ""
    features: list[Feature] = Field(
        default_factory=list,
        description="the features (feature axes) this row honours; a call asking for one "
                    "it does not list is not served by it: " + ", ".join(FEATURE_AXES),
    )
    requires: list[ModuleName] = Field(
        default_factory=list,
        description="optional packages this row needs: when one is not installed the row "
                    "is unavailable (any other import failure is a load error)",
    )


class TableFile(FileModel):
    """A family's decision table: rows in priority order."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, title="astrai decision table (version 1)"
    )

    version: StrictInt
    family: FamilyName
    description: StrictStr = ""
    env_alias: Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    axes: list[AxisModel] = Field(default_factory=list)
    define: Definitions = Field(
        default_factory=dict,
        description="named sub-expressions: each is an expression over the family's axes "
                    "(and earlier or later definitions, never itself), usable as an atom "
                    "in any row's 'when' and in profiles' rows for this family",
    )
    context: ImportPath | None = Field(
        default=None,
        description="for astrai.ops.call: a callable taking the call's arguments and "
                    "returning the family's axis values (default: read from the first tensor)",
    )
    fallback: Name
    rows: list[RowModel] = Field(min_length=1)


class OverlayRowModel(RowModel):
    """A row a row overlay joins to an existing family, with where it goes."""

    before: Name | None = Field(
        default=None, description="place the row just before this row of the family")
    after: Name | None = Field(
        default=None, description="place the row just after this row of the family")

    @model_validator(mode="after")
    def _one_anchor(self) -> OverlayRowModel:
        if self.before is not None and self.after is not None:
            raise ValueError("give 'before' or 'after', not both")
        return self


class OverlayFile(FileModel):
    """A row overlay: rows that join an existing family (a plugin's, usually), each
    placed ``before:``/``after:`` a named row, by default before the family's first
    faithful row (rows of one file keep their order)."""

    model_config = ConfigDict(extra="forbid", frozen=True,
                              title="astrai row overlay (version 1)")

    version: StrictInt
    extends: FamilyName = Field(description="the family the rows join")
    description: StrictStr = ""
    rows: list[OverlayRowModel] = Field(min_length=1)


class FamilyOverlayModel(FileModel):
    """What a profile changes in one family (or in every family, under ``"*"``)."""

    force: Name | None = Field(
        default=None, description="a row name, or 'fallback': route every implicit call there"
    )
    order: list[Name] = Field(
        default_factory=list, description="these rows first, in this order; the rest after"
    )
    disable: list[Name] = Field(default_factory=list, description="rows left out of the chain")
    enable: list[Name] = Field(
        default_factory=list,
        description="non-faithful or explicit-only rows allowed in the implicit chain"
    )
    when: dict[Name, Expression] = Field(
        default_factory=dict, description="replace rows' expressions"
    )
    chain_when: dict[Name, Expression] = Field(
        default_factory=dict,
        description="where the implicit chain may try a row (and-ed with its when); "
                    "selecting the row by name, or forcing it, keeps its own when "
                    "(astrai-ops tune writes its buckets here)")
    fallback: Name | None = None
    add: list[RowModel] = Field(default_factory=list, description="new rows, placed first")
    model_code: StrictBool = Field(
        default=False,
        description="a model routed by dispatch_model while this profile is in force leaves "
                    "this family to the model's own code (astrai.tune_model writes it where "
                    "the model's code measured faster than the routed call beyond the noise; "
                    "the figures are in provenance.model_code)")


class MeasuredModel(FileModel):
    """One cell of a tuned profile's measured table: a row timed on a shape bucket."""

    family: StrictStr
    bucket: StrictStr = Field(description="the bucket's condition (a spec expression)")
    row: Name
    median_us: float = Field(description="median microseconds per call")
    spread_us: float = Field(description="interquartile range of the samples (microseconds)")
    interval_us: list[float] | None = Field(
        default=None, min_length=2, max_length=2,
        description="the median's 95% confidence interval [low, high] (microseconds)")
    samples: StrictInt = Field(default=0, ge=0, description="timed samples per call, at least")
    winner: StrictBool = False
    verdict: StrictStr = Field(
        default="", description="for the winner: why it won (faster: beyond the noise; "
                                "shipped, tie, cannot tell, cannot tell (busy): the shipped "
                                "row stays; no shipped: the shipped row was excluded)")


class NoiseModel(FileModel):
    """Whether the machine was quiet while tune measured (``astrai.tune.noise``)."""

    quiet: StrictBool
    cpu_share: float = Field(description="the share of a core tune's thread got while spinning")
    other_runnable: float | None = Field(
        default=None, description="other runnable tasks at the median timing round")
    interval_width: float | None = Field(
        default=None, description="median relative width of the rows' 95% intervals")
    busy_calls: StrictInt = Field(
        default=0, ge=0, description="calls timed while other processes competed for the "
                                     "cores (each keeps its shipped row)")


class InModelModel(FileModel):
    """A family measured inside the model: a representative run timed with the family left
    to the model's own code and routed, in interleaved rounds (``astrai.tune.in_model``)."""

    run: StrictStr = Field(description="what one run is, in words")
    model_us: float = Field(description="the run with the family left to the model's own "
                                        "code: median microseconds")
    model_interval_us: list[float] = Field(
        min_length=2, max_length=2, description="its 95% confidence interval [low, high]")
    astrai_us: float = Field(description="the run with the family routed: median microseconds")
    astrai_interval_us: list[float] = Field(
        min_length=2, max_length=2, description="its 95% confidence interval [low, high]")
    ratio: float = Field(description="median over rounds of the routed run's time over the "
                                     "run's with the family left to the model")
    ratio_interval: list[float] = Field(
        min_length=2, max_length=2, description="the ratio's 95% confidence interval")
    rounds: StrictInt = Field(default=0, ge=0, description="timed rounds")
    busy: StrictBool = Field(default=False,
                             description="other processes competed for the CPU meanwhile")
    verdict: StrictStr = Field(
        default="", description="faster: the model's code beats the routed run beyond the "
                                "noise; routed, tie, cannot tell, cannot tell (busy): the "
                                "family stays routed")


class CodeFiguresModel(FileModel):
    """One family's calls timed two ways: the model's own code and the routed call,
    microseconds per call (means over the recorded calls, weighted by their counts)."""

    calls: StrictInt = Field(ge=0, description="the recorded calls the figures cover")
    model_us: float = Field(description="the model's own code: median microseconds per call")
    model_interval_us: list[float] = Field(
        min_length=2, max_length=2, description="its 95% confidence interval [low, high]")
    astrai_us: float = Field(description="the routed call: median microseconds per call")
    astrai_interval_us: list[float] = Field(
        min_length=2, max_length=2, description="its 95% confidence interval [low, high]")
    samples: StrictInt = Field(default=0, ge=0, description="timed samples per call, at least")
    busy: StrictBool = Field(default=False,
                             description="other processes competed for the CPU meanwhile")
    in_model: InModelModel | None = Field(
        default=None, description="the family measured inside the model: whole runs with "
                                  "it left to the model's own code and routed")


class ModelCodeModel(CodeFiguresModel):
    """A family's own-code candidate (``astrai.tune_model``): the figures of every model
    tuned on the machine combined, the verdict, and each model's own figures."""

    left_to_model: StrictBool = Field(
        description="whether the family is left to the model's own code (model_code)")
    verdict: StrictStr = Field(
        description="faster: the model's code beats the routed call beyond the noise; "
                    "shipped, tie, cannot tell, cannot tell (busy): the routed call stays")
    models: dict[StrictStr, CodeFiguresModel] = Field(
        default_factory=dict, description="each model's own figures, by model")


class ProvenanceModel(FileModel):
    """Where a tuned profile's order comes from (``astrai-ops tune``)."""

    machine: MachineModel = Field(description="the fingerprint of the machine it was tuned on")
    tuned: StrictStr = Field(description="when (ISO 8601, UTC)")
    workload: StrictStr = Field(default="", description="the recorded workload it was tuned on")
    rounds: StrictInt = Field(default=0, description="timed rounds per call")
    ranks: StrictInt = Field(default=1, description="ranks whose timings were combined "
                                                    "(median across ranks)")
    threads: StrictInt = Field(default=0, ge=0,
                               description="torch intra-op threads the rows were timed at")
    timed: StrictStr = Field(default="", description="what a sample times, in words")
    budget_s: float = Field(default=0.0, ge=0.0,
                            description="seconds allowed for extra rounds where unclear")
    noise: NoiseModel | None = Field(default=None,
                                     description="whether the machine was quiet meanwhile")
    measured: list[MeasuredModel] = Field(default_factory=list,
                                          description="row x bucket -> median microseconds")
    model_code: dict[StrictStr, ModelCodeModel] = Field(
        default_factory=dict,
        description="per family routed in a model: its calls timed in the model's own code "
                    "against the routed call (astrai.tune_model)")


class ProfileFile(FileModel):
    """A profile: an overlay applied on top of the tables when active."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="astrai profile (version 1)")

    version: StrictInt
    profile: Name
    description: StrictStr = ""
    families: dict[StrictStr, FamilyOverlayModel]
    provenance: ProvenanceModel | None = Field(
        default=None, description="for a tuned profile: the machine, versions, date, workload "
                                  "and measurements its order comes from")


def json_schemas() -> dict[str, dict[str, Any]]:
    """``{file name: JSON Schema}`` of the table, profile and row overlay formats."""
    return {
        "table.schema.json": TableFile.model_json_schema(),
        "profile.schema.json": ProfileFile.model_json_schema(),
        "overlay.schema.json": OverlayFile.model_json_schema(),
    }
