"""Walks one chain run: independent nodes run concurrently, each node starts when its
dependencies are done, and every step is reported as a RunEvent on a queue the
servicer streams to the caller.

What happens when a node fails (seed 2.3, 4.1, 4.3):
  * every node runs under min(its timeout, what is left of the chain's end-to-end
    budget = its SLO latency); the remaining time travels as the gRPC deadline to the
    scheduler and worker, so an abandoned hop stops using the engine;
  * failed attempts are retried with exponential backoff and jitter when that is safe
    (idempotent tools, tools that honour idempotency keys, model hops with `retries`),
    each retry spending one unit of the run's retry budget;
  * then the degradation ladder: fallback model, last cached result (even stale),
    declared static fallback, skip when `critical: false`; recorded per node;
  * under load above the threshold, nodes with a fallback model use it at once and
    non-critical nodes are skipped, before the SLO is missed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from inferx import telemetry
from inferx.chain.plan import TIMEOUTS, ChainPlan, LatencyEstimate, LearnedLatency
from inferx.chain.schema import ChainConfig, NodeSpec
from inferx.chain.subchains import MAX_DEPTH, child_inputs, fan_out_items, target_of
from inferx.chain.template import MissingReferenceError, render, static_head
from inferx.errors import Aborted, InferxError, InvalidArgument, NotFound, Unavailable
from inferx.openai_compat.reasoning import split_reasoning
from inferx.pricing import (
    FALLBACK_MODEL,
    PRIMARY,
    SKIPPED,
    BudgetPlan,
    Price,
    estimate_hop_cost,
    step_within,
)
from inferx.resilience import Degradation, NodeFallbacks, RetryBudget, backoff_s, degradation_ladder
from inferx.scheduling.views import Tier
from inferx.tokens import estimate_tokens, shared_prefix
from inferx.v1 import router_pb2
from inferx_router import costs, metrics, records
from inferx_router.chain_store import StoredVersion
from inferx_router.hops import ModelExecutor, ModelHop, NextHop
from inferx_router.load import LoadMonitor
from inferx_router.off_peak import OffPeakPlan, Waiting, wait_for_room
from inferx_router.tools import SESSION_MEMORY, CircuitOpen, ToolCall, ToolRouter

log = logging.getLogger("inferx.router.run")

# Backoff jitter for every run: a Random per run seeded itself from the OS's entropy
# (~0.4% of the router's CPU under load, issue #14) for a few draws at most.
_JITTER = random.Random()

# Errors that retrying cannot fix: the request itself is wrong.
NOT_RETRYABLE = (InvalidArgument, NotFound)


@dataclass
class NodeOutcome:
    finished: router_pb2.NodeFinished
    done: asyncio.Event = field(default_factory=asyncio.Event)


class ChainDeadline(Exception):
    """The chain's end-to-end budget is spent."""


class ChildFailed(Aborted):
    """A `type: chain` node's child run did not finish ok."""


# (tenant, name, version, label) -> the stored version (ChainStore.resolve)
ResolveChain = Callable[[str, str, int, str], Awaitable[StoredVersion]]


@dataclass(frozen=True)
class ParentLink:
    """A child run's parent: the run and the `type: chain` node that started it, and the
    prefix of the child's hop ids (``node/`` or ``node[i]/`` for a for_each item)."""

    run: ChainRun
    node_id: str
    hop_prefix: str


def default_prompt(node: NodeSpec, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    """Without a template: stable part first (inputs), then upstream results, so hops of
    one chain share a prefix the engine's prefix cache can reuse."""
    lines = [f"{key}: {value}" for key, value in sorted(inputs.items())]
    lines += [f"[{dep}] {outputs.get(dep, '')}" for dep in node.depends_on]
    lines.append(f"Task ({node.id}):")
    return "\n".join(lines)


@functools.lru_cache(maxsize=4096)  # a stored config's few templates, on every run
def template_prefix(template: str) -> tuple[str, int]:
    """The shared prefix a node's prompt template names: its static head, the same in
    every run (inferx.tokens.shared_prefix)."""
    return shared_prefix(static_head(template))


def tool_output_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def failure_reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, CircuitOpen):
        return "circuit_open"
    return "error"


class ChainRun:
    def __init__(
        self,
        chain: StoredVersion,
        inputs: dict[str, str],
        *,
        session_id: str,
        tier: int,
        executor: ModelExecutor,
        tools: ToolRouter,
        load: LoadMonitor | None = None,
        latency: LearnedLatency | None = None,
        rng: random.Random | None = None,
        node_events: bool = True,
        reasoning_parser: Callable[[str], str] | None = None,
        resolve_chain: ResolveChain | None = None,
        parent: ParentLink | None = None,
        off_peak: OffPeakPlan | None = None,
        price_of: Callable[[str], Price] | None = None,
        run_id: str = "",
        ab_arm: str = "",
    ) -> None:
        self.chain = chain
        self.plan: ChainPlan = chain.plan
        self.config: ChainConfig = chain.config
        self.inputs = inputs
        self.session_id = session_id
        self.run_id = run_id or uuid.uuid4().hex[:16]
        self.ab_arm = ab_arm  # the A/B test's arm this run took (inferx.ab), "" outside one
        self.tier = Tier(tier) if tier else Tier.parse(self.config.tier)
        self._executor = executor
        # model -> its pool's reasoning parser ("" = none; PoolDirectory.reasoning_parser)
        self._reasoning_parser = reasoning_parser
        self._tools = tools
        self._load = load
        # Expected node times (learned from finished nodes): the remaining critical
        # path the scheduler orders by is expected time, not the sum of timeouts.
        self._learned = latency
        self._latency: LatencyEstimate = latency if latency is not None else TIMEOUTS
        self._rng = rng or _JITTER
        # False (RunChainRequest.final_only): only chain_finished goes to `events`; each
        # event is a message on the caller's stream, the costliest thing per hop after the
        # hop itself, and a caller waiting for the result reads the hops from it anyway.
        self._node_events = node_events
        self.budget = RetryBudget(self.config.retry_budget)
        self.events: asyncio.Queue[router_pb2.RunEvent | None] = asyncio.Queue()
        self._outcomes: dict[str, NodeOutcome] = {}
        self._outputs: dict[str, str] = {}
        # The one deadline of the run, on the monotonic clock; unix time only on the wire.
        self._started = time.monotonic()
        self._deadline = self._started + self.config.slo.latency_p99_ms / 1000
        self._deadline_unix_ms = int(time.time() * 1000 + self.config.slo.latency_p99_ms)
        self._model_hops_done = 0
        self._node_deadlines: dict[str, float] = {}  # node id -> end of its current bound
        # Sub-agent chains: how `type: chain` nodes find their child's version, and for a
        # child run, its parent, whose deadline, tier, retry budget and scheduling key
        # (run id, so one chain key for affinity) it shares.
        self._resolve_chain = resolve_chain
        self._parent = parent
        self._scheduling_run_id, self._hop_prefix = self.run_id, ""
        self._ancestry: tuple[str, ...] = (self.config.name,)
        self._hop_counter = [0]  # model hops of the whole tree of runs so far
        self._slo_ms = self.config.slo.latency_p99_ms
        self._has_children = any(node.type == "chain" for node in self.config.nodes)
        # An off-peak run (schedule: off_peak): its deadline is `within` from now, and its
        # model hops wait for room (inferx_router.off_peak).
        self._off_peak = off_peak
        if off_peak is not None:
            self._deadline = self._started + off_peak.within_s
            self._deadline_unix_ms = int(time.time() * 1000 + off_peak.within_s * 1000)
            self._slo_ms = off_peak.within_s * 1000
        if parent is not None:
            self._inherit(parent)
        # Cost (inferx.pricing): model -> its pool's price; the plan within slo.max_cost.
        self._price_of = price_of
        self.budget_plan: BudgetPlan | None = None

    def plan_cost(self) -> None:
        """Plan the run within its slo.max_cost before it starts (OverBudget: it cannot fit)."""
        if self._price_of is not None:
            self.budget_plan = costs.budget_plan(self.config, self.inputs, self._price_of, self._latency)

    def _budget_step(self, node: NodeSpec) -> str:
        """The plan's choice for a model node about to run, checked against what is left of
        slo.max_cost now that its prompt is known (inferx.pricing.step_within)."""
        plan, price_of = self.budget_plan, self._price_of
        if plan is None or price_of is None or self.config.slo.max_cost is None:
            return PRIMARY
        finished = {n for n, outcome in self._outcomes.items() if outcome.done.is_set()}
        spent = sum(self._outcomes[n].finished.cost for n in finished)
        others = sum(cost for n, cost in plan.estimates.items() if n != node.id and n not in finished)
        try:
            prompt = render(node.prompt, self.inputs, self._outputs) if node.prompt else None
        except MissingReferenceError:
            prompt = node.prompt
        tokens = estimate_tokens(
            prompt if prompt is not None else default_prompt(node, self.inputs, self._outputs)
        )
        expected_s = self._latency.node_ms(self.config.name, node) / 1000

        def estimate(model: str) -> float:
            return estimate_hop_cost(
                price_of(model), prompt_tokens=tokens, max_tokens=node.max_tokens, expected_s=expected_s
            )

        return step_within(
            self.config.slo.max_cost - spent - others,
            estimate(node.model or ""),
            estimate(node.fallback_model) if node.fallback_model else None,
            skippable=not node.critical,
        )

    def _inherit(self, link: ParentLink) -> None:
        up = link.run
        self._deadline, self._deadline_unix_ms = up._deadline, up._deadline_unix_ms
        self._slo_ms = max((up._deadline - self._started) * 1000, 0.0)  # what is left of it
        self.tier, self.budget = up.tier, up.budget
        self._scheduling_run_id = up._scheduling_run_id
        self._hop_prefix = up._hop_prefix + link.hop_prefix
        self._ancestry = (*up._ancestry, self.config.name)
        self._hop_counter = up._hop_counter
        self._off_peak = up._off_peak

    def _at_ms(self) -> float:
        return (time.monotonic() - self._started) * 1000

    def _remaining_s(self) -> float:
        return self._deadline - time.monotonic()

    def _emit(self, **event: Any) -> None:
        self.events.put_nowait(router_pb2.RunEvent(run_id=self.run_id, at_ms=self._at_ms(), **event))

    def _emit_node(self, **event: Any) -> None:
        if self._node_events:
            self._emit(**event)

    async def run(self) -> router_pb2.ChainFinished:
        """Execute every node; always ends with a ChainFinished event."""
        nodes = self.plan.nodes
        self._outcomes = {node_id: NodeOutcome(router_pb2.NodeFinished(node_id=node_id)) for node_id in nodes}
        # One trace per run: node spans (and the hops' gRPC spans) are children of this one.
        attributes = {
            "inferx.run_id": self.run_id,
            "inferx.chain": self.config.name,
            "inferx.chain.version": self.chain.version,
            "inferx.tenant": self.chain.tenant,
            "inferx.tier": self.tier.label,
        }
        with telemetry.span(f"chain {self.config.name}", attributes) as span:
            try:
                await asyncio.gather(*(self._run_node(node) for node in nodes.values()))
            finally:
                finished = self._finish()
                span.set_attributes({"inferx.status": finished.status, "inferx.slo_met": finished.slo_met})
                self._emit(chain_finished=finished)
                self.events.put_nowait(None)
            if finished.status == "ok" and self.session_id and self._parent is None:
                turn = {"inputs": self.inputs, "output": finished.output}
                await self._tools.remember(self.session_id, turn, tenant=self.chain.tenant)
        return finished

    def _finish(self) -> router_pb2.ChainFinished:
        latency_ms = self._at_ms()
        hops = [self._outcomes[node.id].finished for node in self.config.nodes]
        failed = [hop for hop in hops if hop.status not in ("ok", "skipped") or _blocked(hop)]
        if not failed:
            status = "ok"
        elif any(hop.status == "deadline_exceeded" for hop in hops):
            status = "deadline_exceeded"
        else:
            status = "error"
        slo_ms = self._slo_ms  # a child run's: what was left of its parent's deadline
        output = "\n".join(self._outputs.get(node_id, "") for node_id in self.plan.sinks)
        finished = router_pb2.ChainFinished(
            run_id=self.run_id,
            status=status,
            latency_ms=latency_ms,
            slo_ms=slo_ms,
            slo_met=status == "ok" and latency_ms <= slo_ms,
            cost=sum(hop.cost for hop in hops),
            max_cost=self.config.slo.max_cost or 0.0,
            ab_arm=self.ab_arm,
            hops=hops,
            chain_version=self.chain.version,
            output=output,
            error="; ".join(f"{hop.node_id}: {hop.error}" for hop in failed if hop.error),
            retries_used=self.budget.used,
        )
        if self.config.slo.max_cost is not None and finished.cost > self.config.slo.max_cost:
            finished.slo_met = False
        tier = self.tier.label
        metrics.observe_chain(self.config.name, tier, finished, slo_target=self.config.slo.availability)
        # Each chain's counter counts its own hops: a child run counts its hops under its own
        # chain, so the parent's `type: chain` nodes are left out here (no double count).
        own_cost = sum(
            hop.cost for node, hop in zip(self.config.nodes, hops, strict=True) if node.type != "chain"
        )
        metrics.observe_cost(self.config.name, self.chain.tenant, own_cost)
        if self.ab_arm:
            metrics.observe_ab_run(self.config.name, self.ab_arm, finished)
        records.record_run(
            self.config,
            finished,
            tier=tier,
            trace_id=telemetry.trace_id_of(),
            tenant=self.chain.tenant,
            parent_run_id=self._parent.run.run_id if self._parent else "",
            parent_node_id=self._parent.node_id if self._parent else "",
        )
        return finished

    # ----- one node ------------------------------------------------------------------

    async def _run_node(self, node: NodeSpec) -> None:
        outcome = self._outcomes[node.id]
        result = outcome.finished
        result.node_type = node.type
        try:
            for dep in node.depends_on:
                await self._outcomes[dep].done.wait()
            # A dependency skipped on purpose (critical: false) does not block; a failed one does.
            blocked = [dep for dep in node.depends_on if not _usable(self._outcomes[dep].finished)]
            if blocked:
                result.status = "skipped"
                result.error = f"upstream {', '.join(blocked)} did not finish"
                self._emit_node(node_finished=result)
                return
            self._emit_node(node_started=router_pb2.NodeStarted(node_id=node.id, node_type=node.type))
            started = time.monotonic()
            node_attributes = {"inferx.node": node.id, "inferx.node.type": node.type}
            with telemetry.span(f"node {node.id}", node_attributes) as span:
                await self._execute(node, result)
                result.latency_ms = (time.monotonic() - started) * 1000
                telemetry.finish_node_span(span, result)
            if result.status == "ok" and not result.degradation:
                self._learn(node, result.latency_ms)
            if result.status == "ok" or _usable(result):
                # A node skipped on purpose contributes an empty output downstream.
                self._outputs[node.id] = result.output
            metrics.observe_node(self.config.name, node.id, result)
            self._emit_node(node_finished=result)
        finally:
            outcome.done.set()

    async def _execute(self, node: NodeSpec, result: router_pb2.NodeFinished) -> None:
        model = node.model or ""
        planned = self.budget_plan.choice(node.id) if self.budget_plan is not None else ""
        if planned == PRIMARY and node.kind.is_model:
            planned = self._budget_step(node)  # again, with the upstream outputs known now
        if planned == SKIPPED:
            self._skip(result, "budget")
            metrics.observe_degradation(self.config.name, node.id, "skipped")
            return
        if planned == FALLBACK_MODEL and node.fallback_model:
            model = node.fallback_model
            result.degradation, result.degradation_reason = Degradation.FALLBACK_MODEL, "budget"
            metrics.observe_degradation(self.config.name, node.id, str(Degradation.FALLBACK_MODEL))
        elif self._load is not None and node.kind.is_model and self._load.overloaded(model):
            if node.fallback_model:
                model = node.fallback_model
                result.degradation, result.degradation_reason = Degradation.FALLBACK_MODEL, "overload"
            elif not node.critical:
                self._skip(result, "overload")
                return
        if self._off_peak is not None and node.kind.is_model:
            await self._wait_for_room(node, model)
        try:
            await self._bounded(node, self._attempts(node, result, model))
            result.status = "ok"
            return
        except ChainDeadline:
            result.status, result.error = "deadline_exceeded", "the chain's end-to-end budget is spent"
            return
        except MissingReferenceError as exc:
            # Validation guarantees references are upstream; this only trips on a
            # dependency that produced nothing, which is this node's failure, not a crash.
            failure: InferxError | TimeoutError = InvalidArgument(str(exc))
        except (InferxError, TimeoutError) as exc:
            failure = exc
        result.error = _describe(failure, node)
        await self._degrade(node, result, failure, tried_fallback_model=model != (node.model or ""))

    async def _wait_for_room(self, node: NodeSpec, model: str) -> None:
        """An off-peak run's model hop: wait while its pool is busy (or outside quiet
        hours), never past the latest start that still meets the run's deadline."""
        assert self._off_peak is not None
        monitor = self._load
        waiting = Waiting(
            self.run_id, self.chain.tenant, self.config.name, node.id, model, time.monotonic(), "", 0
        )
        await wait_for_room(
            self._off_peak,
            waiting,
            deadline=self._deadline,
            remaining_s=self.plan.remaining_path_ms(node.id, self._latency) / 1000,
            load=lambda: monitor.load(model) if monitor is not None else None,
        )

    async def _bounded(self, node: NodeSpec, work) -> None:
        """Run `work` within the node's timeout and the chain's remaining budget."""
        remaining = self._remaining_s()
        if remaining <= 0:
            work.close()
            raise ChainDeadline
        limit = min(node.timeout_ms / 1000, remaining)
        # Every attempt inside (retries too) is told what is left of this bound, not
        # a fresh node timeout: that is the deadline that travels downstream.
        self._node_deadlines[node.id] = time.monotonic() + limit
        try:
            async with asyncio.timeout(limit):
                await work
        except TimeoutError:
            if limit < node.timeout_ms / 1000:
                raise ChainDeadline from None
            raise

    def _time_left(self, node: NodeSpec) -> float:
        """Seconds left of the node's current bound (node timeout within the chain's budget)."""
        deadline = self._node_deadlines.get(node.id, self._deadline)
        return max(min(deadline, self._deadline) - time.monotonic(), 0.001)

    async def _attempts(self, node: NodeSpec, result: router_pb2.NodeFinished, model: str) -> None:
        """The first attempt and the retries this node may take."""
        retries = self._retries_allowed(node)
        attempt = 0
        while True:
            try:
                kind = "model" if node.kind.is_model else "tool"
                with telemetry.span(f"{kind} attempt", {"inferx.attempt": attempt + 1}):
                    if node.kind.is_model:
                        await self._model_hop(node, result, model)
                    elif node.type == "chain":
                        await self._chain_call(node, result)
                    else:
                        await self._tool_call(node, result)
                return
            except NOT_RETRYABLE:
                raise
            except (InferxError, TimeoutError) as exc:
                attempt += 1
                if attempt > retries or not self.budget.try_spend():
                    raise
                result.retries = attempt
                metrics.observe_retry(self.config.name, node.id, failure_reason(exc))
                await asyncio.sleep(backoff_s(attempt, rng=self._rng))

    def _retries_allowed(self, node: NodeSpec) -> int:
        if node.type == "chain":  # a retry runs the whole child again: only when asked
            return node.retries
        if node.kind.is_model:
            return node.retries or node.kind.default_retries
        if not node.idempotent:
            try:
                tool = self._tools.resolve(node.tool or SESSION_MEMORY)
            except NotFound:
                return 0
            # A non-idempotent tool is retried only when its server de-duplicates by key.
            if not tool.honours_idempotency_key:
                return 0
        return node.retries or node.kind.default_retries

    # ----- degradation ---------------------------------------------------------------

    async def _degrade(
        self,
        node: NodeSpec,
        result: router_pb2.NodeFinished,
        failure: BaseException,
        *,
        tried_fallback_model: bool,
    ) -> None:
        reason = failure_reason(failure)
        stale_found, stale = False, None
        if not node.kind.is_model and node.cacheable and node.type != "chain":
            stale_found, stale = await self._tools.stale_result(
                node.tool or SESSION_MEMORY, self._arguments(node), tenant=self.chain.tenant
            )
        options = NodeFallbacks(
            fallback_model=node.fallback_model if node.kind.is_model else None,
            has_stale_result=stale_found,
            fallback_output=node.fallback_output,
            critical=node.critical,
        )
        for step in degradation_ladder(options, tried_fallback_model=tried_fallback_model):
            if step == Degradation.FALLBACK_MODEL:
                try:
                    await self._bounded(node, self._model_hop(node, result, node.fallback_model or ""))
                except (InferxError, TimeoutError, ChainDeadline):
                    continue
            elif step == Degradation.STALE_CACHE:
                result.output, result.cache_hit = tool_output_text(stale), True
            elif step == Degradation.STATIC_FALLBACK:
                result.output = node.fallback_output or ""
            elif step == Degradation.SKIPPED:
                self._skip(result, reason)
                metrics.observe_degradation(self.config.name, node.id, str(step))
                return
            result.status, result.degradation, result.degradation_reason = "ok", str(step), reason
            metrics.observe_degradation(self.config.name, node.id, str(step))
            return
        result.status = "timeout" if reason == "timeout" else "error"

    def _skip(self, result: router_pb2.NodeFinished, reason: str) -> None:
        result.status, result.degradation, result.degradation_reason = "skipped", "skipped", reason
        result.output = ""

    # ----- the two kinds of work ----------------------------------------------------

    async def _model_hop(self, node: NodeSpec, result: router_pb2.NodeFinished, model: str) -> None:
        result.model = model
        prefix_id, prefix_tokens = "", 0
        if node.prompt:
            prompt = render(node.prompt, self.inputs, self._outputs)
            prefix_id, prefix_tokens = template_prefix(node.prompt)
        else:  # starts with the run's inputs: nothing other runs share
            prompt = default_prompt(node, self.inputs, self._outputs)
        hop = ModelHop(
            run_id=self._scheduling_run_id,  # a child's hops are its root run's, to the scheduler
            hop_id=self._hop_prefix + node.id,
            session_id=self.session_id,
            chain_name=self.config.name,
            chain_version=self.chain.version,
            tier=self.tier,
            priority=node.priority_rank,
            deadline_unix_ms=self._deadline_unix_ms,
            hop_index=self._hop_counter[0],
            # With child runs in the tree the hops still to come are not known here.
            remaining_hops=(
                None
                if self._has_children or self._parent is not None
                else max(self.plan.model_hops - self._model_hops_done - 1, 0)
            ),
            remaining_critical_path_ms=self.plan.remaining_path_ms(node.id, self._latency),
            next_hops=self._next_hops(node, prompt),
            model=model,
            prompt=prompt,
            max_tokens=node.max_tokens,
            temperature=node.temperature,
            stop=tuple(node.stop),
            max_context_tokens=node.max_context_tokens or 0,
            truncate_context=node.context_overflow == "truncate",
            prefix_id=prefix_id,
            prefix_tokens=prefix_tokens,
        )

        def dispatched(worker_id: str) -> None:
            result.worker_id = worker_id

        # The deadline the caller set (node timeout or chain budget) travels downstream.
        timeout = self._time_left(node)
        # Asked before the hop runs: a mapping naming an unknown parser fails the node first.
        parser = self._reasoning_parser(model) if self._reasoning_parser is not None else ""
        sent = time.monotonic()
        done = await self._executor.run_hop(hop, timeout, dispatched)
        worker_s = max(time.monotonic() - sent - done.queue_ms / 1000, 0.0)
        if parser:  # the thinking apart: `{{ nodes.X.output }}` is the answer
            thought, result.output = split_reasoning(done.text, parser)
            result.reasoning = thought or ""
        else:
            result.output = done.text
        result.usage.prompt_tokens = done.prompt_tokens
        result.usage.completion_tokens = done.completion_tokens
        result.usage.cached_prompt_tokens = done.cached_prompt_tokens
        result.queue_ms = done.queue_ms
        result.worker_id = done.worker_id
        if self._price_of is not None:
            result.cost = costs.cost_of_hop(self._price_of(model), result, worker_s)
        self._model_hops_done += 1
        self._hop_counter[0] += 1

    async def _chain_call(self, node: NodeSpec, result: router_pb2.NodeFinished) -> None:
        """A sub-agent: run the child chain (once, or once per for_each item, at most
        `max_concurrency` at a time) within this run's deadline; the output is the child's
        (a JSON array of the children's, in item order, for a for_each)."""
        assert node.chain is not None
        if self._resolve_chain is None:
            raise Unavailable("this router cannot run sub-agent chains")
        if node.chain in self._ancestry:
            raise InvalidArgument(f"chain: cycle {' -> '.join([*self._ancestry, node.chain])}")
        if len(self._ancestry) >= MAX_DEPTH:
            raise InvalidArgument(f"chain: chains nest more than {MAX_DEPTH} deep")
        try:
            child = await self._resolve_chain(
                self.chain.tenant, node.chain, node.version or 0, node.label or ""
            )
        except InferxError as exc:
            raise InvalidArgument(f"chain {target_of(node)}: {exc.message}") from None
        given = {name: render(template, self.inputs, self._outputs) for name, template in node.inputs.items()}
        if node.for_each is None:
            batches = [(f"{node.id}/", given)]
        else:
            items = fan_out_items(render(node.for_each, self.inputs, self._outputs))
            batches = [(f"{node.id}[{i}]/", {**given, node.item_input: item}) for i, item in enumerate(items)]
        runs = [
            ChainRun(
                child,
                child_inputs(child.config, inputs),
                session_id=self.session_id,
                tier=int(self.tier),
                executor=self._executor,
                tools=self._tools,
                load=self._load,
                latency=self._learned,
                rng=self._rng,
                node_events=False,
                reasoning_parser=self._reasoning_parser,
                resolve_chain=self._resolve_chain,
                price_of=self._price_of,  # a child's hops are priced as the parent's are
                parent=ParentLink(self, node.id, prefix),
            )
            for prefix, inputs in batches
        ]
        for run in runs:
            run.plan_cost()  # a child's own slo.max_cost, as a run's (OverBudget: the node fails)
        del result.child_run_ids[:]  # a retry's children replace the last try's
        result.child_run_ids.extend(run.run_id for run in runs)
        gate = asyncio.Semaphore(node.max_concurrency)

        async def one(run: ChainRun) -> router_pb2.ChainFinished:
            async with gate:
                return await run.run()

        finished = await asyncio.gather(*(one(run) for run in runs))
        for done in finished:
            # What the children cost is this node's (a failed child's hops cost all the same):
            # the run's cost, its slo.max_cost and the tenant's hourly budget include it.
            result.cost += done.cost
            for hop in done.hops:
                result.usage.prompt_tokens += hop.usage.prompt_tokens
                result.usage.completion_tokens += hop.usage.completion_tokens
                result.usage.cached_prompt_tokens += hop.usage.cached_prompt_tokens
        failed = [(i, done) for i, done in enumerate(finished) if done.status != "ok"]
        if any(done.status == "deadline_exceeded" for _, done in failed):
            raise ChainDeadline
        if failed:
            i, done = failed[0]
            which = f" (item {i})" if node.for_each is not None else ""
            raise ChildFailed(
                f"child run {done.run_id}{which} of '{child.name}': {done.status}: {done.error}"
            )
        outputs = [done.output for done in finished]
        result.output = json.dumps(outputs, ensure_ascii=False) if node.for_each is not None else outputs[0]

    def _next_hops(self, node: NodeSpec, prompt: str) -> tuple[NextHop, ...]:
        """The model hops that can follow this one. Their prompts are not rendered yet:
        estimated as this prompt plus this hop's output, since each hop extends the context."""
        tokens = estimate_tokens(prompt) + node.max_tokens
        return tuple(
            NextHop(hop_id=nxt.id, model=nxt.model or "", prompt_tokens=tokens, max_tokens=nxt.max_tokens)
            for nxt in map(self.plan.node, self.plan.next_model_hops[node.id])
        )

    def _learn(self, node: NodeSpec, latency_ms: float) -> None:
        if self._learned is not None:
            self._learned.observe(self.config.name, node.id, latency_ms)

    def _arguments(self, node: NodeSpec) -> dict[str, Any]:
        if node.arguments:
            arguments: dict[str, Any] = {
                name: render(template, self.inputs, self._outputs)
                for name, template in node.arguments.items()
            }
        else:
            arguments = dict(self.inputs)
        if "limit" in node.kind.keys and node.tool == SESSION_MEMORY:
            arguments.setdefault("limit", node.limit)
        return arguments

    async def _tool_call(self, node: NodeSpec, result: router_pb2.NodeFinished) -> None:
        tool = node.tool or SESSION_MEMORY
        result.tool = tool
        call = ToolCall(
            tool,
            self._arguments(node),
            self.run_id,
            self.session_id,
            self._time_left(node),
            # Stable across retries of this node in this run: a tool that honours it
            # performs the side effect once however often it is called.
            idempotency_key=f"{self.run_id}:{node.id}",
            tenant=self.chain.tenant,
        )
        outcome = await self._tools.call(call, cacheable=node.cacheable, cache_ttl_s=node.cache_ttl_ms / 1000)
        result.output = tool_output_text(outcome.value)
        result.cache_hit = outcome.cache_hit
        if node.cacheable:
            metrics.observe_tool_cache(tool, hit=outcome.cache_hit, unavailable=outcome.cache_unavailable)
        result.cache_unavailable = outcome.cache_unavailable


def _usable(hop: router_pb2.NodeFinished) -> bool:
    return hop.status == "ok" or (hop.status == "skipped" and hop.degradation == "skipped")


def _blocked(hop: router_pb2.NodeFinished) -> bool:
    """Skipped because an upstream node failed (not skipped on purpose)."""
    return hop.status == "skipped" and hop.degradation != "skipped"


def _describe(exc: BaseException, node: NodeSpec) -> str:
    if isinstance(exc, TimeoutError):
        return f"timed out after {node.timeout_ms:g}ms"
    if isinstance(exc, InferxError):
        return exc.message
    return str(exc) or type(exc).__name__
