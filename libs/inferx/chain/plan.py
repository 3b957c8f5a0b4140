"""What is fixed for a chain version, computed once: the `ChainPlan`.

A stored chain version never changes, so its graph facts (run order, who depends on
whom, the outputs, which model hops may follow each node, how many model hops a run
has) are worked out once when the version is loaded and shared by every run of it.

The one number that is not fixed is how long the rest of a run will take. The
scheduler orders hops by slack = deadline - remaining critical path, so the remaining
path must be the *expected* time, not the worst case: `remaining_path_ms` takes a
`LatencyEstimate`. In production that is `LearnedLatency` (per node, learned online
from the run's own finished hops; the node's timeout until there is history); the
simulator passes its own estimate. Validation uses `TIMEOUTS` (the worst case is what
an SLO check must compare against).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from inferx.chain.kinds import node_kind
from inferx.chain.schema import ChainConfig, ChainConfigError, NodeSpec
from inferx.stats import RunningMean


class LatencyEstimate(Protocol):
    def node_ms(self, chain: str, node: NodeSpec) -> float:
        """Expected time of one node of chain `chain`, in ms."""
        ...


class TimeoutLatency:
    """The worst case: every node takes its whole timeout."""

    def node_ms(self, chain: str, node: NodeSpec) -> float:
        return node.timeout_ms


TIMEOUTS = TimeoutLatency()


class LearnedLatency:
    """Expected node latency learned online from finished nodes: an exponentially
    weighted mean per (chain, node). Until a node has `min_samples` observations its
    timeout stands in (the only thing known about it), so early runs are ordered
    conservatively rather than optimistically."""

    def __init__(self, alpha: float = 0.2, min_samples: int = 3, max_nodes: int = 100_000) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.min_samples = min_samples
        self._max_nodes = max_nodes
        self._mean: dict[tuple[str, str], RunningMean] = {}

    def observe(self, chain: str, node_id: str, latency_ms: float) -> None:
        if latency_ms < 0:
            return
        key = (chain, node_id)
        mean = self._mean.get(key)
        if mean is None:
            if len(self._mean) >= self._max_nodes:
                self._mean.pop(next(iter(self._mean)))  # bounded: forget the oldest node seen
            mean = self._mean[key] = RunningMean(self.alpha)
        mean.add(latency_ms)

    def node_ms(self, chain: str, node: NodeSpec) -> float:
        mean = self._mean.get((chain, node.id))
        if mean is None or mean.count < self.min_samples:
            return node.timeout_ms
        return min(mean.value, node.timeout_ms)  # a node never takes longer than its timeout


def topological_order(config: ChainConfig) -> list[str]:
    """Node ids with every node after its dependencies; ties keep file order."""
    index = {node.id: i for i, node in enumerate(config.nodes)}
    waiting = {node.id: set(node.depends_on) for node in config.nodes}
    unknown = sorted({dep for deps in waiting.values() for dep in deps} - set(index))
    if unknown:
        raise ChainConfigError([f"depends_on: unknown node(s) {', '.join(unknown)}"])
    dependents = _dependents(config)
    ready = [(index[node_id], node_id) for node_id, deps in waiting.items() if not deps]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, node_id = heapq.heappop(ready)
        order.append(node_id)
        for dependent in dependents[node_id]:
            waiting[dependent].discard(node_id)
            if not waiting[dependent]:
                heapq.heappush(ready, (index[dependent], dependent))
    if len(order) != len(index):
        stuck = [node_id for node_id in index if node_id not in order]
        raise ChainConfigError([f"dependency cycle among nodes {', '.join(stuck)}"])
    return order


def _dependents(config: ChainConfig) -> dict[str, list[str]]:
    dependents: dict[str, list[str]] = {node.id: [] for node in config.nodes}
    for node in config.nodes:
        for dep in node.depends_on:
            if dep in dependents and node.id not in dependents[dep]:
                dependents[dep].append(node.id)
    return dependents


@dataclass(frozen=True)
class ChainPlan:
    config: ChainConfig
    order: tuple[str, ...]  # run order (dependencies first; ties keep file order)
    dependents: Mapping[str, tuple[str, ...]]
    sinks: tuple[str, ...]  # nodes nothing depends on: the run's output, in file order
    next_model_hops: Mapping[str, tuple[str, ...]]  # model nodes that may come right after
    model_hops: int  # model nodes in a run
    nodes: Mapping[str, NodeSpec]

    @classmethod
    def build(cls, config: ChainConfig) -> ChainPlan:
        """The plan of a config whose dependencies are known and acyclic
        (ChainConfigError otherwise)."""
        order = topological_order(config)
        dependents = {node_id: tuple(children) for node_id, children in _dependents(config).items()}
        nodes = {node.id: node for node in config.nodes}
        next_models: dict[str, tuple[str, ...]] = {}
        for node_id in reversed(order):
            found: list[str] = []
            for child in dependents[node_id]:
                # A model node is a next hop itself; any other node is passed through.
                if node_kind(nodes[child].type).is_model:
                    found.append(child)
                else:
                    found.extend(next_models[child])
            next_models[node_id] = tuple(dict.fromkeys(found))
        return cls(
            config=config,
            order=tuple(order),
            dependents=dependents,
            sinks=tuple(node.id for node in config.nodes if not dependents[node.id]),
            next_model_hops=next_models,
            model_hops=sum(node_kind(node.type).is_model for node in config.nodes),
            nodes=nodes,
        )

    def node(self, node_id: str) -> NodeSpec:
        return self.nodes[node_id]

    def remaining_paths_ms(self, estimate: LatencyEstimate = TIMEOUTS) -> dict[str, float]:
        """For each node: the longest expected path from it (included) to the end."""
        longest: dict[str, float] = {}
        for node_id in reversed(self.order):
            after = max((longest[child] for child in self.dependents[node_id]), default=0.0)
            longest[node_id] = estimate.node_ms(self.config.name, self.nodes[node_id]) + after
        return longest

    def remaining_path_ms(self, node_id: str, estimate: LatencyEstimate = TIMEOUTS) -> float:
        return self.remaining_paths_ms(estimate)[node_id]

    def critical_path(self, estimate: LatencyEstimate = TIMEOUTS) -> tuple[list[str], float]:
        """The dependency path with the largest sum of node times, and that sum in ms."""
        best: dict[str, tuple[float, str | None]] = {}
        for node_id in self.order:
            node = self.nodes[node_id]
            via = max(node.depends_on, key=lambda dep: best[dep][0], default=None)
            before = best[via][0] if via is not None else 0.0
            best[node_id] = (before + estimate.node_ms(self.config.name, node), via)
        if not best:
            return [], 0.0
        last = max(best, key=lambda node_id: best[node_id][0])  # first of equals wins
        path: list[str] = []
        step: str | None = last
        while step is not None:
            path.append(step)
            step = best[step][1]
        return path[::-1], best[last][0]
