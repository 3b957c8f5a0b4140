"""What model hops cost, and keeping a chain run within its `slo.max_cost` (pure code).

A model pool has a price in etcd (`/inferx/v1/prices/<pool>`, `inferx pool price`): per
1k prompt tokens, per 1k prompt tokens served from the prefix cache, per 1k output tokens
and per GPU-second (the hop's time on the worker, queue excluded). A hop's cost follows
from its usage; a run's is the sum of its hops'. Costs are in whatever currency the
prices are written in; InferX never converts.

Before a run with `slo.max_cost` starts, each model node's cost is estimated from above
(its prompt estimate, all of `max_tokens` generated, none of the prompt cached) and
`plan_within` picks the cheapest changes that bring the estimate under the budget:
first a node's `fallback_model` (when it is cheaper), then skipping non-critical nodes.
A run whose least possible estimate is over the budget is refused (`OverBudget`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from inferx.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

PRICE_FIELDS = ("prompt_per_1k", "cached_per_1k", "output_per_1k", "gpu_second")

# What a node runs as, in a plan.
PRIMARY = "primary"
FALLBACK_MODEL = "fallback_model"
SKIPPED = "skipped"


@dataclass(frozen=True)
class Price:
    """A pool's price. `cached_per_1k` None: cached prompt tokens cost as others do."""

    prompt_per_1k: float = 0.0
    cached_per_1k: float | None = None
    output_per_1k: float = 0.0
    gpu_second: float = 0.0

    @property
    def free(self) -> bool:
        return not (self.prompt_per_1k or self.cached_per_1k or self.output_per_1k or self.gpu_second)

    @property
    def cached_rate(self) -> float:
        return self.prompt_per_1k if self.cached_per_1k is None else self.cached_per_1k

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, sort_keys=True)


FREE = Price()


def check_amount(name: str, value: Any) -> float:
    """A price or budget: a finite number >= 0; InvalidArgument naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name}: must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{name}: must be a finite number >= 0, got {value!r}")
    return float(value)


def parse_price(raw: Any) -> Price:
    """A price from its stored (JSON object) form, checked; InvalidArgument naming the
    field that is wrong."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise InvalidArgument(f"price: not JSON ({exc})") from None
    if not isinstance(raw, Mapping):
        raise InvalidArgument(f"price: must be an object of {', '.join(PRICE_FIELDS)}")
    unknown = sorted(set(raw) - set(PRICE_FIELDS))
    if unknown:
        raise InvalidArgument(f"price: unknown field '{unknown[0]}'; fields: {', '.join(PRICE_FIELDS)}")
    values: dict[str, Any] = {name: check_amount(name, raw[name]) for name in PRICE_FIELDS if name in raw}
    return Price(**values)


def hop_cost(
    price: Price,
    *,
    prompt_tokens: int,
    cached_prompt_tokens: int = 0,
    completion_tokens: int = 0,
    gpu_seconds: float = 0.0,
) -> float:
    """What one hop cost: uncached and cached prompt tokens, output tokens, GPU time."""
    cached = min(max(cached_prompt_tokens, 0), max(prompt_tokens, 0))
    uncached = max(prompt_tokens, 0) - cached
    return (
        uncached * price.prompt_per_1k / 1000
        + cached * price.cached_rate / 1000
        + max(completion_tokens, 0) * price.output_per_1k / 1000
        + max(gpu_seconds, 0.0) * price.gpu_second
    )


def estimate_hop_cost(price: Price, *, prompt_tokens: int, max_tokens: int, expected_s: float) -> float:
    """An upper estimate of a hop before it runs: no prompt cached, all of max_tokens."""
    return hop_cost(price, prompt_tokens=prompt_tokens, completion_tokens=max_tokens, gpu_seconds=expected_s)


@dataclass(frozen=True)
class NodeCost:
    """A model node's estimated cost as declared, with its fallback model (None: it has
    none), and whether it may be skipped (`critical: false`)."""

    node_id: str
    primary: float
    fallback: float | None = None
    skippable: bool = False


@dataclass(frozen=True)
class BudgetPlan:
    choices: Mapping[str, str]  # node id -> PRIMARY | FALLBACK_MODEL | SKIPPED
    estimate: float  # the plan's estimated cost
    estimates: Mapping[str, float] = field(default_factory=dict)  # node id -> its share of it

    def choice(self, node_id: str) -> str:
        return self.choices.get(node_id, PRIMARY)


class OverBudget(FailedPrecondition):
    """No plan fits: even the cheapest way through the chain is estimated over budget."""

    def __init__(self, chain: str, least: float, max_cost: float) -> None:
        self.least, self.max_cost = least, max_cost
        super().__init__(
            f"chain '{chain}' would cost at least {format_cost(least)} (estimated), over its "
            f"slo.max_cost {format_cost(max_cost)}; raise the budget or use cheaper models"
        )


def _cost_of(node: NodeCost, choice: str) -> float:
    if choice == SKIPPED:
        return 0.0
    if choice == FALLBACK_MODEL and node.fallback is not None:
        return node.fallback
    return node.primary


def least_cost(nodes: Iterable[NodeCost]) -> float:
    """The cheapest estimate any plan can reach."""
    return sum(
        0.0 if n.skippable else min(n.primary, n.fallback if n.fallback is not None else n.primary)
        for n in nodes
    )


def plan_within(chain: str, nodes: Sequence[NodeCost], max_cost: float) -> BudgetPlan:
    """The plan that changes fewest nodes to bring the estimate to `max_cost` or under:
    cheaper fallback models first (the largest saving first), then skipped non-critical
    nodes (the largest saving first). OverBudget when even the cheapest plan is over."""
    choices = {n.node_id: PRIMARY for n in nodes}
    total = sum(n.primary for n in nodes)
    if total <= max_cost:
        return BudgetPlan(choices, total, {n.node_id: n.primary for n in nodes})
    least = least_cost(nodes)
    if least > max_cost:
        raise OverBudget(chain, least, max_cost)
    fallbacks = sorted(
        (n for n in nodes if n.fallback is not None and n.fallback < n.primary),
        key=lambda n: n.fallback - n.primary if n.fallback is not None else 0.0,
    )
    for node in fallbacks:
        if total <= max_cost:
            break
        total -= node.primary - _cost_of(node, FALLBACK_MODEL)
        choices[node.node_id] = FALLBACK_MODEL
    skips = sorted((n for n in nodes if n.skippable), key=lambda n: -_cost_of(n, choices[n.node_id]))
    for node in skips:
        if total <= max_cost:
            break
        total -= _cost_of(node, choices[node.node_id])
        choices[node.node_id] = SKIPPED
    estimates = {n.node_id: _cost_of(n, choices[n.node_id]) for n in nodes}
    return BudgetPlan(choices, sum(estimates.values()), estimates)


def step_within(left: float, estimate: float, fallback: float | None, *, skippable: bool) -> str:
    """What a node about to run does once its prompt is known, with `left` of the run's
    budget for it (max_cost - what finished nodes cost - the plan's estimates of the
    others not finished): PRIMARY when its estimate fits, FALLBACK_MODEL when a cheaper
    fallback model's does, SKIPPED when it may be skipped, else PRIMARY (a critical node
    runs; the run then misses its cost SLO)."""
    if estimate <= left:
        return PRIMARY
    if fallback is not None and fallback < estimate and fallback <= left:
        return FALLBACK_MODEL
    if skippable:
        return SKIPPED
    return PRIMARY


def format_cost(value: float) -> str:
    """A cost for people: 4 significant digits, never scientific for usual amounts."""
    if value == 0:
        return "0"
    if abs(value) >= 0.01:
        return f"{value:,.4f}".rstrip("0").rstrip(".")
    return f"{value:.4g}"


class PriceBook:
    """Every pool's price, as mirrored from etcd (`update` takes the mirror's items);
    a malformed entry is logged and priced as free, never a failed run."""

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix
        self._prices: dict[str, Price] = {}
        self.problems: dict[str, str] = {}

    def update(self, items: Mapping[str, bytes]) -> None:
        prices: dict[str, Price] = {}
        problems: dict[str, str] = {}
        for key, value in items.items():
            pool = key.removeprefix(self._prefix)
            try:
                prices[pool] = parse_price(value)
            except InvalidArgument as exc:
                problems[pool] = f"the price at {key}: {exc.message}"
                log.error("%s", problems[pool])
        self._prices, self.problems = prices, problems

    def of(self, pool: str) -> Price:
        return self._prices.get(pool, FREE)

    def has(self, pool: str) -> bool:
        return pool in self._prices

    def items(self) -> list[tuple[str, Price]]:
        return sorted(self._prices.items())
