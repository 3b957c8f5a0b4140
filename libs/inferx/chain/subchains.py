"""Sub-agent chains: a `type: chain` node runs another stored chain (pure code, no I/O).

Three things live here, each a plain function the router (and tests) call:

* `reference_problems`: at `chain put`, every chain node must name a chain, version or
  label that exists, and following those references (a child's own chain nodes too)
  must never come back to a chain on the way: a cycle would run forever. The lookup of
  stored versions is the caller's (`resolve`); each problem names the node.
* `fan_out_items`: the list a node's rendered `for_each` gives (a JSON array, else one
  item per non-empty line).
* `child_inputs`: a child run's inputs checked against the child chain's declared
  inputs, as `RunChain` checks a caller's.

A label or active pointer moved after a put can still close a cycle; the router guards
each run too (`MAX_DEPTH` and its chain of ancestors).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from inferx.chain.schema import ChainConfig, NodeSpec
from inferx.chain.validate import required_inputs
from inferx.errors import InferxError, InvalidArgument

MAX_DEPTH = 8  # chains within chains, the top one counted: deeper is refused
MAX_ITEMS = 256  # children of one for_each

# (name, version, label) -> the stored chain's config; raises NotFound (an InferxError)
Resolve = Callable[[str, int, str], Awaitable[ChainConfig]]


def target_of(node: NodeSpec) -> str:
    """How a chain node names its child: ``'name'``, ``'name' v3``, ``'name' label 'prod'``."""
    where = f" v{node.version}" if node.version else (f" label '{node.label}'" if node.label else "")
    return f"'{node.chain}'{where}"


async def reference_problems(config: ChainConfig, resolve: Resolve) -> list[str]:
    """Every chain node of `config` (about to be stored) whose child is missing or leads
    back to a chain already on the path (a cycle), one line each naming the node."""
    problems: list[str] = []
    for node in config.nodes:
        if node.type != "chain" or node.chain is None:
            continue
        problem = await _walk(node, [config.name], resolve, depth=1)
        if problem:
            problems.append(f"node '{node.id}': chain: {problem}")
    return problems


async def _walk(node: NodeSpec, path: list[str], resolve: Resolve, depth: int) -> str:
    assert node.chain is not None
    if node.chain in path:
        return f"cycle {' -> '.join([*path, node.chain])}"
    if depth >= MAX_DEPTH:
        return f"chains nest more than {MAX_DEPTH} deep: {' -> '.join([*path, node.chain])}"
    try:
        child = await resolve(node.chain, node.version or 0, node.label or "")
    except InferxError as exc:
        return f"{target_of(node)} cannot be run: {exc.message}"
    for grandchild in child.nodes:
        if grandchild.type == "chain" and grandchild.chain is not None:
            problem = await _walk(grandchild, [*path, node.chain], resolve, depth + 1)
            if problem:
                return problem
    return ""


def fan_out_items(rendered: str) -> list[str]:
    """The items of a rendered `for_each`: a JSON array (items that are not strings
    as JSON text), else one per non-empty line (stripped). InvalidArgument for more
    than MAX_ITEMS, or a JSON value that is not an array."""
    text = rendered.strip()
    items: list[str]
    parsed: Any = None
    if text[:1] in ("[", "{", '"'):
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
    if isinstance(parsed, list):
        items = [item if isinstance(item, str) else json.dumps(item, ensure_ascii=False) for item in parsed]
    elif parsed is not None:
        raise InvalidArgument(f"for_each: gave a JSON {type(parsed).__name__}, not a list")
    else:
        items = [line.strip() for line in text.splitlines() if line.strip()]
    if len(items) > MAX_ITEMS:
        raise InvalidArgument(f"for_each: gave {len(items)} items, more than {MAX_ITEMS}")
    return items


def child_inputs(config: ChainConfig, given: Mapping[str, str]) -> dict[str, str]:
    """`given` checked against the child chain's inputs, defaults filled in."""
    inputs = dict(given)
    if config.inputs:
        unknown = sorted(set(inputs) - set(config.inputs))
        if unknown:
            raise InvalidArgument(
                f"input '{unknown[0]}': chain '{config.name}' takes {', '.join(sorted(config.inputs))}"
            )
        for name, spec in config.inputs.items():
            if name not in inputs and spec.default is not None:
                inputs[name] = spec.default
    missing = [name for name in required_inputs(config) if name not in inputs]
    if missing:
        raise InvalidArgument(f"input '{missing[0]}': required by chain '{config.name}' and not given")
    return inputs
