"""Loading and checking chain configs, and the graph helpers the runtime uses.

`load_chain_text` turns YAML or JSON text into a `ValidatedChain` or raises
`ChainConfigError` listing *every* problem found, one per line: the error's
message is the problems joined with newlines (``"\\n"``), so a CLI can print it
as-is and a gRPC status detail stays readable. Each problem names where it is:
``node 'ID': FIELD: ...`` for nodes, ``slo.end_to_end_latency_p99: ...`` for
chain fields, ``SOURCE:LINE:COLUMN: ...`` for YAML syntax errors.

Problems are found in two layers that both always run, so a config with a bad
timeout *and* a dependency cycle reports both: pydantic checks each value
(`schema.py`), then the graph checks here run on the typed config, or, when
pydantic rejected something, on a lenient view of the raw mapping.

Decisions:

* SLO check: the critical path is the longest chain of node ``timeout``s through
  the DAG. Exceeding ``end_to_end_latency_p99`` is a *warning* by default,
  because timeouts are upper bounds and a chain whose p99 sits well under them
  is normal; with ``strict=True`` it is an error. ``strict=True`` turns every
  warning into an error (the other warnings are keys a node type ignores).
* When a chain declares no inputs, every ``{{ inputs.X }}`` in its templates is
  an implicitly required input; when it declares any, references to others are
  errors. An empty ``inputs:`` counts as declaring none.
* Duplicate YAML keys are rejected (plain yaml silently keeps the last one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError

from inferx.chain.durations import format_duration_ms
from inferx.chain.kinds import node_kind
from inferx.chain.plan import ChainPlan, topological_order
from inferx.chain.schema import (
    COMMON_NODE_KEYS,
    NODE_TYPES,
    TYPE_NODE_KEYS,
    ChainConfig,
    ChainConfigError,
    InputSpec,
    NodeSpec,
    describe_validation_error,
    node_label,
    suggest,
)
from inferx.chain.template import check_template, references
from inferx.limits import RequestLimits

__all__ = [
    "ChainConfigError",
    "ValidatedChain",
    "critical_path",
    "load_chain_document",
    "load_chain_text",
    "required_inputs",
    "sinks",
    "topological_order",
    "upstream",
    "validate_chain",
]

MAX_CONFIG_CHARS = 1_000_000
# Bound on values after YAML alias expansion ("billion laughs" protection).
MAX_CONFIG_VALUES = 100_000


@dataclass(frozen=True)
class ValidatedChain:
    config: ChainConfig
    warnings: list[str]
    plan: ChainPlan  # built once here; every run of this config shares it


# --------------------------------------------------------------------------- loading


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        # Merge keys ("<<") may legitimately be overridden, so only plain scalars count.
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first at line {seen[key].line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
    return loader.construct_mapping(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _construct_str(loader: _Loader, node: yaml.ScalarNode) -> str:
    """Strings, with the surrogate pairs of JSON-style escapes joined: YAML reads
    "\\ud83d\\ude00" as two lone surrogates where JSON means one character. A lone one
    stays, and `_parse` reports it."""
    value = loader.construct_scalar(node)
    assert isinstance(value, str)
    if _is_unicode(value):
        return value
    try:
        return value.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        return value


_Loader.add_constructor("tag:yaml.org,2002:str", _construct_str)


def _parse(text: str, source: str) -> Any:
    if len(text) > MAX_CONFIG_CHARS:
        raise ChainConfigError([f"{source}: config is larger than {MAX_CONFIG_CHARS} characters"])
    try:
        document = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        context = f" ({exc.context})" if exc.context else ""
        raise ChainConfigError([f"{where}: invalid YAML/JSON: {exc.problem}{context}"]) from None
    except yaml.YAMLError as exc:
        raise ChainConfigError([f"{source}: invalid YAML/JSON: {exc}"]) from None
    except RecursionError:
        raise ChainConfigError([f"{source}: config is nested too deeply"]) from None
    # Count values as a walk of the expanded tree, so aliases count once per use.
    budget, stack = MAX_CONFIG_VALUES, [document]
    while stack:
        value = stack.pop()
        budget -= 1
        if budget < 0:
            raise ChainConfigError([f"{source}: config has more than {MAX_CONFIG_VALUES} values"])
        if isinstance(value, dict):
            stack.extend(value.values())
            stack.extend(key for key in value if isinstance(key, str))
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and not _is_unicode(value):
            # YAML and JSON escapes can spell a lone UTF-16 surrogate ("\ud800"): not
            # text, and nothing downstream (protobuf, etcd, error messages) can carry it.
            shown = value.encode("utf-8", "backslashreplace").decode()
            raise ChainConfigError([f"{source}: '{shown[:60]}': not valid Unicode (a lone surrogate)"])
    return document


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _unwrap(document: Any, source: str) -> Mapping[str, Any]:
    if document is None:
        raise ChainConfigError([f"{source}: the config is empty; expected an 'agent_chain' mapping"])
    if not isinstance(document, dict):
        raise ChainConfigError(
            [
                f"{source}: the config must be a mapping with an 'agent_chain' key, "
                f"got a {type(document).__name__}"
            ]
        )
    problems = [
        f"{source}: unknown top-level key '{key}'{suggest(str(key), ['agent_chain'])}"
        for key in document
        if key != "agent_chain"
    ]
    if "agent_chain" not in document:
        problems.append(f"{source}: missing top-level key 'agent_chain'")
    elif not isinstance(document["agent_chain"], dict):
        problems.append(f"agent_chain: must be a mapping, got {document['agent_chain']!r:.60}")
    if problems:
        raise ChainConfigError(problems)
    return document["agent_chain"]


def load_chain_text(
    text: str, *, strict: bool = False, source: str = "<config>", limits: RequestLimits | None = None
) -> ValidatedChain:
    """Parse and fully check a chain config (YAML or JSON text). With `limits` (a
    router's), a config over its size, node or output-token limits is refused too."""
    if limits is not None and (problem := limits.config_problem(text)):
        raise ChainConfigError([problem])  # before parsing: its size is the problem
    return load_chain_document(_parse(text, source), strict=strict, source=source, limits=limits)


def load_chain_document(
    document: Any, *, strict: bool = False, source: str = "<config>", limits: RequestLimits | None = None
) -> ValidatedChain:
    """Fully check an already parsed config document (``{"agent_chain": {...}}``), e.g.
    a version read back from etcd: the text-size caps of `load_chain_text` do not apply."""
    chain = _unwrap(document, source)
    raw_nodes = chain.get("nodes")
    if limits is not None and isinstance(raw_nodes, list):
        if problem := limits.nodes_problem(len(raw_nodes)):
            raise ChainConfigError([problem])  # before checking each of them
    try:
        config = ChainConfig.model_validate(chain)
    except ValidationError as exc:
        problems = describe_validation_error(exc, chain)
        if isinstance(raw_nodes, list):
            extra = _graph_problems(_raw_views(raw_nodes), _raw_declared_inputs(chain.get("inputs")))
            problems += [problem for problem in extra if problem not in problems]
        raise ChainConfigError(problems) from None
    limit_problems = _limit_problems(config, limits) if limits is not None else []
    try:
        warnings = validate_chain(config, strict=strict)
    except ChainConfigError as exc:
        raise ChainConfigError(limit_problems + exc.problems) from None
    if limit_problems:
        raise ChainConfigError(limit_problems)
    return ValidatedChain(config, warnings, ChainPlan.build(config))


def _limit_problems(config: ChainConfig, limits: RequestLimits) -> list[str]:
    """A router's limits on a typed config (the node count is checked earlier, raw)."""
    problems = []
    for node in config.nodes:
        if node.kind.is_model and (
            problem := limits.output_tokens_problem(f"node '{node.id}': max_tokens", node.max_tokens)
        ):
            problems.append(problem)
    return problems


def validate_chain(config: ChainConfig, strict: bool = False) -> list[str]:
    """The warnings for an already-built config; raises ChainConfigError on problems."""
    # Typed nodes go through the same view as raw mappings: one set of graph checks.
    views = _raw_views([node.model_dump() for node in config.nodes])
    problems = _graph_problems(views, set(config.inputs) or None)
    problems += [
        problem for node in config.nodes if node.type == "chain" for problem in _chain_node_problems(node)
    ]
    warnings = [
        f"node '{node.id}': {key}: ignored for {node.type} nodes"
        for node in config.nodes
        for key in _document_keys(node.model_fields_set)
        if key not in COMMON_NODE_KEYS + TYPE_NODE_KEYS[node.type]
    ]
    if not problems:  # the critical path needs an acyclic graph with known deps
        path, total_ms = ChainPlan.build(config).critical_path()
        if total_ms > config.slo.latency_p99_ms:
            warnings.append(
                f"critical path {' -> '.join(path)} takes up to {format_duration_ms(total_ms)} "
                f"of timeouts, more than the {format_duration_ms(config.slo.latency_p99_ms)} SLO"
            )
    if strict:
        problems, warnings = problems + warnings, []
    if problems:
        raise ChainConfigError(problems)
    return warnings


def _chain_node_problems(node: NodeSpec) -> list[str]:
    """What a `type: chain` node says that cannot work, on its own (the chain it names
    is checked against the stored chains when it is put: `inferx.chain.subchains`)."""
    label = f"node '{node.id}'"
    problems = []
    if node.version is not None and node.label is not None:
        problems.append(f"{label}: version, label: give one of them, not both")
    if node.for_each is None:
        for key in ("item_input", "max_concurrency"):
            if key in node.model_fields_set:
                problems.append(f"{label}: {key}: only used with for_each")
    else:
        if not node.for_each.strip():
            problems.append(f"{label}: for_each: must not be empty (a list, or a template giving one)")
        if node.item_input in node.inputs:
            problems.append(
                f"{label}: inputs.{node.item_input}: set by for_each (item_input: {node.item_input}); "
                "remove it or pick another item_input"
            )
    return problems


def _document_keys(field_names: Iterable[str]) -> list[str]:
    aliases = {"timeout_ms": "timeout", "cache_ttl_ms": "cache_ttl"}
    return sorted(aliases.get(name, name) for name in field_names)


# --------------------------------------------------------------------------- graph checks


@dataclass(frozen=True)
class _View:
    """What the graph checks need from a node."""

    index: int  # position in `nodes`, for messages
    label: str
    id: str | None
    type: str | None
    present: frozenset[str]  # keys set to something other than null
    depends_on: tuple[str, ...]
    templates: tuple[tuple[str, str], ...]


def _raw_views(raw_nodes: list[Any]) -> list[_View]:
    """Views of node mappings (raw, or dumped typed nodes). Wrong-typed parts of a
    raw node are left out: pydantic has already reported them."""
    views = []
    for index, raw in enumerate(raw_nodes):
        if not isinstance(raw, Mapping):
            continue
        node_id = raw.get("id") if isinstance(raw.get("id"), str) else None
        deps = raw.get("depends_on")
        deps = tuple(d for d in deps if isinstance(d, str)) if isinstance(deps, list) else ()
        templates = [("prompt", raw["prompt"])] if isinstance(raw.get("prompt"), str) else []
        arguments = raw.get("arguments")
        if isinstance(arguments, Mapping):
            templates += [(f"arguments.{k}", v) for k, v in arguments.items() if isinstance(v, str)]
        child_inputs = raw.get("inputs")  # a chain node's inputs for its child
        if isinstance(child_inputs, Mapping):
            templates += [(f"inputs.{k}", v) for k, v in child_inputs.items() if isinstance(v, str)]
        if isinstance(raw.get("for_each"), str):
            templates.append(("for_each", raw["for_each"]))
        node_type = raw.get("type") if isinstance(raw.get("type"), str) else None
        views.append(
            _View(
                index,
                node_label(raw_nodes, index),
                node_id,
                node_type,
                frozenset(str(key) for key, value in raw.items() if value is not None),
                deps,
                tuple(templates),
            )
        )
    return views


def _raw_declared_inputs(raw: Any) -> set[str] | None:
    if isinstance(raw, Mapping):
        return {str(name) for name in raw} or None
    if isinstance(raw, list):
        return {name for name in raw if isinstance(name, str)} or None
    return None


def _graph_problems(views: list[_View], declared_inputs: set[str] | None) -> list[str]:
    if not views:
        return ["nodes: a chain needs at least one node"]
    problems: list[str] = []
    first: dict[str, _View] = {}  # each id's first node
    for view in views:
        if view.id is None:
            continue
        if view.id in first:
            problems.append(f"{view.label}: id: duplicate node id (also nodes[{first[view.id].index}])")
        else:
            first[view.id] = view
        required = node_kind(view.type).required if view.type in NODE_TYPES else None
        if required is not None and required not in view.present:
            problems.append(f"{view.label}: {required}: a {view.type} node needs a '{required}'")
    known = list(first)
    deps: dict[str, list[str]] = {node_id: [] for node_id in known}
    for view in views:
        for dep in view.depends_on:
            if dep == view.id:
                problems.append(f"{view.label}: depends_on: a node cannot depend on itself")
            elif dep not in first:
                problems.append(f"{view.label}: depends_on: unknown node '{dep}'{suggest(dep, known)}")
            elif view.id is not None and dep not in deps[view.id]:
                deps[view.id].append(dep)
    for cycle in _cycles(known, deps):
        label = first[cycle[0]].label
        problems.append(f"{label}: depends_on: dependency cycle {' -> '.join(cycle)}")
    for view in views:
        problems += _template_problems(view, first, deps, declared_inputs)
    return problems


def _template_problems(
    view: _View,
    ids: Mapping[str, object],  # the known node ids (only membership is used)
    deps: Mapping[str, list[str]],
    declared_inputs: set[str] | None,
) -> list[str]:
    problems: list[str] = []
    before = _transitive(deps, view.id) if view.id is not None else set()
    for field, template in view.templates:
        problems += [f"{view.label}: {field}: {problem}" for problem in check_template(template)]
        for ref in references(template, skip_errors=True):
            if ref.kind == "inputs":
                if declared_inputs is not None and ref.name not in declared_inputs:
                    hint = suggest(ref.name, sorted(declared_inputs))
                    problems.append(
                        f"{view.label}: {field}: unknown input '{ref.name}'{hint}; "
                        f"declared inputs: {', '.join(sorted(declared_inputs))}"
                    )
            elif ref.name == view.id:
                problems.append(f"{view.label}: {field}: a node cannot use its own output")
            elif ref.name not in ids:
                hint = suggest(ref.name, list(ids))
                problems.append(f"{view.label}: {field}: references unknown node '{ref.name}'{hint}")
            elif ref.name not in before:
                problems.append(
                    f"{view.label}: {field}: references node '{ref.name}', which is not "
                    "upstream of this node (add it to depends_on)"
                )
    return problems


def _transitive(deps: Mapping[str, list[str]], node_id: str) -> set[str]:
    seen: set[str] = set()
    stack = list(deps.get(node_id, ()))
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(deps.get(current, ()))
    return seen


def _cycles(order: list[str], deps: Mapping[str, list[str]]) -> list[list[str]]:
    """Distinct cycles found by depth-first search, each printed in run order
    (``a -> b`` means b depends on a), starting and ending at its earliest node."""
    position = {node_id: index for index, node_id in enumerate(order)}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    found: dict[tuple[str, ...], None] = {}
    for root in order:
        if root in state:
            continue
        stack: list[tuple[str, Any]] = [(root, iter(deps[root]))]
        path, state[root] = [root], 1
        while stack:
            node_id, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node_id] = 2
            elif state.get(child) == 1:
                # path[i:] follows depends_on edges; reversed, it is the run order.
                ring = list(reversed(path[path.index(child) :]))
                start = min(range(len(ring)), key=lambda i: position[ring[i]])
                ring = ring[start:] + ring[:start]
                found.setdefault(tuple(ring + [ring[0]]), None)
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append((child, iter(deps[child])))
    return [list(cycle) for cycle in found]


# --------------------------------------------------------------------------- helpers


def upstream(config: ChainConfig, node_id: str) -> set[str]:
    """Every node `node_id` depends on, directly or transitively."""
    config.node(node_id)  # KeyError for an unknown id rather than an empty set
    return _transitive({node.id: list(node.depends_on) for node in config.nodes}, node_id)


def sinks(config: ChainConfig) -> list[str]:
    """Nodes no other node depends on (the chain's outputs), in file order."""
    needed = {dep for node in config.nodes for dep in node.depends_on}
    return [node.id for node in config.nodes if node.id not in needed]


def required_inputs(config: ChainConfig) -> dict[str, InputSpec]:
    """Inputs a run must supply: declared required ones without a default, or,
    when none are declared, every input the templates reference."""
    if config.inputs:
        return {name: spec for name, spec in config.inputs.items() if spec.required and spec.default is None}
    found: dict[str, InputSpec] = {}
    for node in config.nodes:
        for _, template in node.templates():
            for ref in references(template):
                if ref.kind == "inputs":
                    found.setdefault(ref.name, InputSpec())
    return found


def critical_path(config: ChainConfig) -> tuple[list[str], float]:
    """The dependency path with the largest sum of timeouts, and that sum in ms."""
    return ChainPlan.build(config).critical_path()
