"""Typed model of an agent-chain config (pydantic v2).

The document form is ``{"agent_chain": {...}}``; `ChainConfig` is what is inside.
The seed format's key names are the aliases (``end_to_end_latency_p99``,
``timeout``, ``cache_ttl``) so configs written against it load unchanged, while
code reads unit-explicit attribute names (``latency_p99_ms``, ``timeout_ms``).
Both spellings are accepted on input; output (`to_document`) uses the aliases.

This module checks each value on its own (types, ranges, key names). Checks that
need the whole chain (dependencies, cycles, template references, the SLO) live
in `validate.py`, which also turns pydantic's errors into readable lines via
`describe_validation_error` here. Models are frozen: a loaded config is shared
between runs and must not change under them.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from inferx import MAX_UINT32
from inferx.chain.durations import (
    ValueFormatError,
    format_duration_ms,
    parse_availability,
    parse_duration_ms,
    parse_quiet_hours,
)
from inferx.chain.kinds import MEMORY_RETRIEVAL, node_kind, node_kinds
from inferx.chain.template import INPUT_NAME_RE, NODE_ID_RE
from inferx.errors import InvalidArgument
from inferx.tokens import DEFAULT_MAX_TOKENS

NODE_TYPES: tuple[str, ...] = node_kinds()
NodeType = Literal[NODE_TYPES]  # type: ignore[valid-type]  # the registered kinds, in order
TIERS: tuple[str, ...] = ("realtime", "standard", "batch")
PRIORITIES: tuple[str, ...] = ("high", "medium", "normal", "low")  # index = priority_rank
DEFAULT_MEMORY_TOOL = MEMORY_RETRIEVAL.default_tool

# Keys each node type uses beyond the common ones. Others are accepted (extra=forbid
# still rejects unknown keys) but produce an "ignored" warning, and `to_document`
# leaves them out so the normalised form only says what matters.
COMMON_NODE_KEYS = (
    "id",
    "type",
    "depends_on",
    "timeout",
    "priority",
    "critical",
    "retries",
    "idempotent",
    "cacheable",
    "cache_ttl",
    "fallback_output",
)
TYPE_NODE_KEYS: dict[str, tuple[str, ...]] = {name: node_kind(name).keys for name in NODE_TYPES}

# Bounds every config has, whatever a router's limits say: counts travel as uint32 on
# the wire, run deadlines as int64 unix milliseconds, and temperature as OpenAI defines it.
MAX_DURATION_MS = 30 * 24 * 3_600_000.0  # 30 days: any timeout, SLO or cache TTL
MAX_TEMPERATURE = 2.0

_ID_RE = re.compile(NODE_ID_RE)
_INPUT_RE = re.compile(INPUT_NAME_RE)


def _unit_free(parse: Any) -> Any:
    """Wrap a durations.py parser so errors carry only the problem; the field
    name is added by `describe_validation_error`, which knows the alias."""

    def validate(value: object) -> float:
        try:
            return float(parse(value))
        except ValueFormatError as exc:
            raise ValueError(exc.problem) from None

    return validate


def _check_identifier(value: str) -> str:
    if not _ID_RE.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a valid identifier (letters, digits, '_', '.', '-'; "
            "not starting with '.' or '-')"
        )
    return value


_DURATION_SCHEMA = {
    "anyOf": [
        {"type": "string", "pattern": r"^\s*(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*(ms|s|m|h)?\s*$"},
        {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_DURATION_MS},
    ],
    "description": "positive duration of at most 30 days: '500ms', '3s', '1.5s', '2m', "
    "or a number of milliseconds",
}


def _at_most_max_duration(ms: float) -> float:
    if ms > MAX_DURATION_MS:
        raise ValueError(f"must be at most 30 days ({MAX_DURATION_MS:.0f}ms), got {ms:g}ms")
    return ms


DurationMs = Annotated[
    float,
    BeforeValidator(_unit_free(parse_duration_ms)),
    AfterValidator(_at_most_max_duration),
    WithJsonSchema(_DURATION_SCHEMA),
]
AvailabilityFraction = Annotated[
    float,
    BeforeValidator(_unit_free(parse_availability)),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^\s*[0-9.]+\s*%?\s*$"},
                {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            ],
            "description": "'99.9%' or a fraction in (0, 1]",
        }
    ),
]
Identifier = Annotated[
    str,
    AfterValidator(_check_identifier),
    WithJsonSchema({"type": "string", "pattern": f"^{NODE_ID_RE}$"}),
]


class ChainConfigError(InvalidArgument):
    """An invalid chain config; `.problems` has one line per problem found."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems: list[str] = list(problems)
        super().__init__("\n".join(self.problems))


_MODEL_CONFIG = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class InputSpec(BaseModel):
    """One named input of a chain run (``RunChainRequest.inputs``)."""

    model_config = _MODEL_CONFIG

    required: bool = True
    description: str = ""
    # Used when the caller does not supply the input; an input with a default is
    # therefore never reported by `required_inputs`.
    default: str | None = None


class SloSpec(BaseModel):
    model_config = _MODEL_CONFIG

    latency_p99_ms: DurationMs = Field(alias="end_to_end_latency_p99")
    availability: AvailabilityFraction = 0.999
    # The most a run may cost (inferx.pricing; the pools' prices): the run is planned
    # within it (fallback models, skipped non-critical nodes) or refused.
    max_cost: float | None = Field(None, ge=0, allow_inf_nan=False)


class OffPeakSpec(BaseModel):
    """`schedule: off_peak`: the run may finish as late as `within` after it starts; its
    model hops wait while their pool's load is above `max_load`, or outside
    `quiet_hours` (UTC, e.g. "22-6"; empty: any hour), never later than `within` allows
    (inferx.scheduling.off_peak)."""

    model_config = _MODEL_CONFIG

    within_ms: DurationMs = Field(8 * 3_600_000.0, alias="within")
    max_load: float = Field(0.6, ge=0, le=10, allow_inf_nan=False)
    quiet_hours: str = ""

    @field_validator("quiet_hours")
    @classmethod
    def _hours(cls, value: str) -> str:
        parse_quiet_hours(value)  # ValueError names the bad part
        return value


class NodeSpec(BaseModel):
    """One step of the chain: a model call, a tool call or a memory lookup."""

    model_config = _MODEL_CONFIG

    id: Identifier
    type: NodeType
    model: str | None = None
    tool: str | None = None
    depends_on: list[str] = Field(default_factory=list)
    prompt: str | None = None
    arguments: dict[str, str] = Field(default_factory=dict)
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, gt=0, le=MAX_UINT32)
    temperature: float = Field(0.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    # The model's output ends before the first of these it writes (vLLM's stop strings).
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=16)
    fallback_model: str | None = None
    critical: bool = True
    retries: int = Field(0, ge=0, le=10)
    idempotent: bool = True
    max_context_tokens: int | None = Field(None, gt=0, le=MAX_UINT32)
    context_overflow: Literal["reject", "truncate"] = "reject"
    cache_ttl_ms: DurationMs = Field(300_000.0, alias="cache_ttl")
    priority: Literal["high", "medium", "normal", "low"] = "normal"
    cacheable: bool = False
    timeout_ms: DurationMs = Field(30_000.0, alias="timeout")
    limit: int = Field(5, gt=0, le=MAX_UINT32)
    # Degradation: the output to return when the node fails and nothing better is
    # available (after retries, fallback model and the last cached result).
    fallback_output: str | None = None
    # `type: chain` (a sub-agent): the stored chain it runs, pinned to a version or a
    # label (neither: the active version), the child's inputs as templates, and an
    # optional fan-out: one child per item of the rendered `for_each` list (a JSON array,
    # or one item per non-empty line), the item given as input `item_input`, at most
    # `max_concurrency` children at a time.
    chain: Identifier | None = None
    version: int | None = Field(None, gt=0, le=MAX_UINT32)
    label: Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")] | None = None
    inputs: dict[str, str] = Field(default_factory=dict)
    for_each: str | None = None
    item_input: Annotated[str, Field(pattern=f"^{INPUT_NAME_RE}$")] = "item"
    max_concurrency: int = Field(4, gt=0, le=64)

    @model_validator(mode="before")
    @classmethod
    def _default_tool(cls, data: Any) -> Any:
        # e.g. memory nodes read the session store unless they name another memory tool.
        if isinstance(data, Mapping) and data.get("type") in NODE_TYPES and data.get("tool") is None:
            default = node_kind(data["type"]).default_tool
            if default is not None:
                data = {**data, "tool": default}
        return data

    @field_validator("for_each", mode="before")
    @classmethod
    def _for_each_list(cls, value: Any) -> Any:
        # `for_each: [a, b]` is a literal list: kept as the JSON text a template would give.
        if isinstance(value, list):
            if not all(isinstance(item, str) for item in value):
                raise ValueError("a literal for_each list holds strings only")
            return json.dumps(value, ensure_ascii=False)
        return value

    @property
    def kind(self):  # -> NodeKind (annotated loosely: pydantic inspects property types)
        return node_kind(self.type)

    @property
    def priority_rank(self) -> int:
        """0 (high) .. 3 (low): lower runs first, as in ``HopContext.priority``."""
        return PRIORITIES.index(self.priority)

    def templates(self) -> list[tuple[str, str]]:
        """(field, template) for every templated value: the prompt and each argument."""
        found = [("prompt", self.prompt)] if self.prompt is not None else []
        found += [(f"arguments.{key}", value) for key, value in self.arguments.items()]
        found += [(f"inputs.{key}", value) for key, value in self.inputs.items()]
        if self.for_each is not None:
            found.append(("for_each", self.for_each))
        return found

    def to_document(self) -> dict[str, Any]:
        """This node in the normalised document form (only the keys its type uses)."""
        document: dict[str, Any] = {}
        for key in COMMON_NODE_KEYS + TYPE_NODE_KEYS[self.type]:
            value = getattr(self, _attribute(key))
            if value is None:
                continue
            if key in ("timeout", "cache_ttl"):
                value = format_duration_ms(value)
            elif isinstance(value, (list, dict)):
                value = type(value)(value)  # a copy: the document must not alias the config
            document[key] = value
        return document


class ChainConfig(BaseModel):
    """The contents of ``agent_chain``: a named DAG of nodes with an SLO."""

    model_config = _MODEL_CONFIG

    name: Identifier
    description: str = ""
    tier: Literal["realtime", "standard", "batch"] = "standard"
    inputs: dict[str, InputSpec] = Field(default_factory=dict)
    slo: SloSpec
    # Retries a whole run may spend across its nodes before taking degradation paths.
    retry_budget: int = Field(3, ge=0, le=100)
    nodes: list[NodeSpec]
    # `off_peak`: runs wait for room (off_peak: within, max_load, quiet_hours); `now`: run at once.
    schedule: Literal["now", "off_peak"] = "now"
    off_peak: OffPeakSpec | None = None

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs_list_form(cls, value: Any) -> Any:
        # `inputs: [question, user_id]` is shorthand for all-required inputs.
        if value is None:
            return {}
        if isinstance(value, list):
            names: dict[str, dict[str, Any]] = {}
            for item in value:
                if not isinstance(item, str):
                    raise ValueError(f"input names must be strings, got {item!r}")
                if item in names:
                    raise ValueError(f"input {item!r} is listed twice")
                names[item] = {}
            return names
        return value

    @field_validator("inputs", mode="after")
    @classmethod
    def _input_names(cls, value: dict[str, InputSpec]) -> dict[str, InputSpec]:
        bad = [name for name in value if not _INPUT_RE.fullmatch(name)]
        if bad:
            raise ValueError(
                f"invalid input name(s) {', '.join(map(repr, bad))}: use letters, digits "
                "and '_', not starting with a digit (they appear as {{ inputs.NAME }})"
            )
        return value

    @property
    def node_ids(self) -> list[str]:
        return [node.id for node in self.nodes]

    def node(self, node_id: str) -> NodeSpec:
        """The node with id `node_id` (KeyError if there is none)."""
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(f"chain {self.name!r} has no node {node_id!r}")

    def to_document(self) -> dict[str, Any]:
        """The normalised ``{"agent_chain": {...}}`` form; loads back to an equal config."""
        chain: dict[str, Any] = {"name": self.name}
        if self.description:
            chain["description"] = self.description
        chain["tier"] = self.tier
        # Left out when empty: "no inputs declared" means "infer them from templates".
        if self.inputs:
            chain["inputs"] = {name: spec.model_dump(exclude_none=True) for name, spec in self.inputs.items()}
        chain["slo"] = {
            "end_to_end_latency_p99": format_duration_ms(self.slo.latency_p99_ms),
            "availability": self.slo.availability,
        }
        if self.slo.max_cost is not None:
            chain["slo"]["max_cost"] = self.slo.max_cost
        chain["retry_budget"] = self.retry_budget
        if self.schedule != "now":
            chain["schedule"] = self.schedule
        if self.off_peak is not None:
            chain["off_peak"] = {
                "within": format_duration_ms(self.off_peak.within_ms),
                "max_load": self.off_peak.max_load,
                "quiet_hours": self.off_peak.quiet_hours,
            }
        chain["nodes"] = [node.to_document() for node in self.nodes]
        return {"agent_chain": chain}

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """JSON Schema of the document form (with the ``agent_chain`` wrapper)."""
        inner = cls.model_json_schema(by_alias=True, mode="validation")
        # $defs must sit at the root for the "#/$defs/..." references to resolve.
        defs = inner.pop("$defs", {})
        return {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "InferX agent chain",
            "type": "object",
            "properties": {"agent_chain": inner},
            "required": ["agent_chain"],
            "additionalProperties": False,
            "$defs": defs,
        }


def _attribute(key: str) -> str:
    """Attribute name of a document key (aliases differ only for durations)."""
    return {"timeout": "timeout_ms", "cache_ttl": "cache_ttl_ms"}.get(key, key)


# ---------------------------------------------------------------------------
# pydantic errors -> readable lines naming the node id and the field

_ENUMS: dict[str, tuple[str, ...]] = {"type": NODE_TYPES, "tier": TIERS, "priority": PRIORITIES}


def _keys_of(model: type[BaseModel]) -> list[str]:
    """Document keys of `model`: aliases where set (the documented spelling)."""
    return [field.alias or name for name, field in model.model_fields.items()]


def _model_at(parent: tuple[Any, ...]) -> type[BaseModel] | None:
    if parent == ():
        return ChainConfig
    if parent == ("slo",):
        return SloSpec
    if parent == ("off_peak",):
        return OffPeakSpec
    if len(parent) == 2 and parent[0] == "nodes" and isinstance(parent[1], int):
        return NodeSpec
    if len(parent) == 2 and parent[0] == "inputs":
        return InputSpec
    return None


def node_label(raw_nodes: Any, index: int) -> str:
    """``node 'ID'`` when the raw node has a usable id, else ``nodes[INDEX]``."""
    if isinstance(raw_nodes, list) and 0 <= index < len(raw_nodes):
        node_id = _raw_id(raw_nodes[index])
        if node_id:
            # A duplicated id alone would not say which of the nodes is meant.
            twins = sum(1 for raw in raw_nodes if _raw_id(raw) == node_id)
            return f"node '{node_id}'" + (f" (nodes[{index}])" if twins > 1 else "")
    return f"nodes[{index}]"


def _raw_id(raw: Any) -> str | None:
    if isinstance(raw, Mapping) and isinstance(raw.get("id"), str):
        return raw["id"]
    return None


def suggest(word: str, candidates: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'X'?)`` for the closest candidate, or an empty string."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_validation_error(error: ValidationError, raw_chain: Mapping[str, Any]) -> list[str]:
    """One readable line per pydantic error of `ChainConfig.model_validate(raw_chain)`."""
    raw_nodes = raw_chain.get("nodes")
    lines: list[str] = []
    for item in error.errors():
        loc = tuple(item["loc"])
        where = ""
        rest = loc
        if len(loc) >= 2 and loc[0] == "nodes" and isinstance(loc[1], int):
            where, rest = node_label(raw_nodes, loc[1]), loc[2:]
        kind, value = item["type"], item.get("input")
        if kind == "extra_forbidden":
            model = _model_at(loc[:-1])
            keys = _keys_of(model) if model else []
            hint = suggest(str(loc[-1]), keys) or (f"; valid keys: {', '.join(keys)}" if keys else "")
            text, rest = f"unknown key '{loc[-1]}'{hint}", rest[:-1]
        elif kind == "invalid_key" or "[key]" in rest:
            # YAML allows non-string keys (`1: x`, `null: x`); none is valid here.
            text = f"keys must be strings, got {_show(value)}"
            rest = rest[: rest.index("[key]") - 1] if "[key]" in rest else rest[:-1]
        elif kind == "missing":
            text, rest = f"missing required key '{loc[-1]}'", rest[:-1]
        elif kind == "literal_error" and str(loc[-1]) in _ENUMS:
            valid = _ENUMS[str(loc[-1])]
            noun = "unknown node type" if loc[-1] == "type" else "unknown value"
            text = f"{noun} {_show(value)}{suggest(str(value), valid)}; valid: {', '.join(valid)}"
        elif kind in ("model_type", "dict_type", "model_attributes_type"):
            text = f"must be a mapping, got {_show(value)}"
        elif kind == "value_error":
            text = str(item["ctx"]["error"])
        else:
            text = item["msg"]
            if text.startswith("Input should be"):
                text = "must be" + text[len("Input should be") :]
            if not isinstance(value, (Mapping, list)):
                text += f", got {_show(value)}"
        path = ".".join(f"[{part}]" if isinstance(part, int) else str(part) for part in rest)
        path = path.replace(".[", "[")
        prefix = ": ".join(part for part in (where, path) if part) or "agent_chain"
        lines.append(f"{prefix}: {text}")
    return lines
