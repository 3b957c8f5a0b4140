"""One model call of a dynamic program: the path the OpenAI-compatible HTTP front and
`Router.CallModel` (gRPC) both take, so the two are thin over the same code.

A call is validated (model served, prompt not empty), counted against its tenant's
limits like a one-hop run, counted into its program (`programs.ProgramBook`: the
record `inferx trace` shows), sent through the scheduler like a declared chain's model
hop (`SchedulerExecutor`), and observed: a span `program <name>` with the program id,
the run id and the hop's usage (the executor's queue/dispatch/engine spans under it),
the chain/node metrics (chain = the program's name, node = "call"), and the record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import context as otel_context

from inferx import telemetry
from inferx.auth.limits import QuotaExceeded, TenantQuotas, TierNotAllowed
from inferx.auth.model import Principal, TenantLimits
from inferx.errors import InferxError
from inferx.limits import RequestLimits
from inferx.openai_compat import schema
from inferx.openai_compat.errors import InvalidField, ModelNotFound, ToolChoiceNotFollowed
from inferx.openai_compat.identity import MAX_DEADLINE_MS, ProgramIdentity, identity_of_fields
from inferx.openai_compat.reasoning import Reasoning
from inferx.openai_compat.render import chat_json, render_chat_and_head
from inferx.openai_compat.schema import ReplyEvent, ReplyReader
from inferx.openai_compat.toolcalls import DEFAULT_FORMAT, Content, ToolCall
from inferx.pools import PoolDirectory
from inferx.pricing import Price
from inferx.tokens import shared_prefix
from inferx.v1 import common_pb2, router_pb2
from inferx_router import costs, metrics
from inferx_router.access import AccessControl
from inferx_router.hops import HopDone, ModelHop
from inferx_router.program_homes import Continuation, ProgramHomes
from inferx_router.programs import Call, Program, ProgramBook, Ticket, program_hop


class StreamingExecutor(Protocol):
    async def run_hop(
        self,
        hop: ModelHop,
        timeout_s: float,
        on_dispatched: Callable[[str], None],
        on_text: Callable[[str], None] | None = None,
    ) -> HopDone: ...


@dataclass(frozen=True)
class CallDone:
    """A finished call: the hop's result and where it went in its program."""

    call: Call
    done: HopDone
    run_id: str  # the program's record
    program_id: str  # as the client gave it ("" for a one-call program)
    call_index: int  # this call's place in the program, from 0
    latency_ms: float
    reply: ReplyReader  # the reply as read to its end: content, tool calls


class ProgramCalls:
    def __init__(
        self,
        directory: PoolDirectory,
        executor: StreamingExecutor,
        *,
        access: AccessControl,
        quotas: TenantQuotas,
        default_timeout_s: float,
        book: ProgramBook | None = None,
        request_limits: RequestLimits | None = None,
        homes: Callable[[ProgramBook], ProgramHomes] | None = None,
    ) -> None:
        self._directory = directory
        self._request_limits = request_limits or RequestLimits()
        self._executor = executor
        self._access = access
        self._quotas = quotas
        self._default_timeout_ms = int(default_timeout_s * 1000)
        self.book = book if book is not None else ProgramBook()
        # Where each open program is held, across routers (None: this router alone).
        self.homes = homes(self.book) if homes is not None else None
        self.book.on_end = self._ended
        # model -> its price (inferx.pricing; the router sets it): each call's cost
        self.price_of: Callable[[str], Price] | None = None

    # ----- requests ---------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        """Models mapped in etcd, and pools with live workers (a pool is a model too)."""
        pools = {pool for pool, workers in self._directory.workers_by_pool.items() if workers}
        return sorted(set(self._directory.model_to_pool) | pools)

    def tool_call_format(self, body: schema.CallRequest) -> str:
        """The format tool calls are read out of the reply in (pools.PoolDirectory:
        the model mapping's, else its workers'); FailedPrecondition for one InferX does
        not know, when the call offers tools."""
        if isinstance(body, schema.ChatCompletionRequest) and body.parses_tool_calls:
            return self._directory.tool_call_format(body.model)
        return DEFAULT_FORMAT

    def reader(self, body: schema.CallRequest) -> ReplyReader:
        """How the call's reply is read, the same for both fronts (schema.reply_reader,
        in its model's tool-call format and reasoning parser). Made before the call: a
        model whose format or parser InferX does not know refuses it."""
        chat = isinstance(body, schema.ChatCompletionRequest)
        reasoning = self._directory.reasoning_parser(body.model) if chat else ""
        return schema.reply_reader(body, self.tool_call_format(body), reasoning)

    def prepare(self, body: schema.CallRequest) -> Call:
        """The call a validated body asks for (chat messages rendered into its prompt)."""
        if body.model not in self.model_names():
            raise ModelNotFound(body.model)
        chat = ""  # a chat call's messages and tools, for the worker's chat template
        head = ""  # what other programs of the same agent send first too
        if isinstance(body, schema.ChatCompletionRequest):
            prompt, head = render_chat_and_head(body.messages, body.tools, body.tool_choice)
            prefix = "chatcmpl"
            chat = chat_json(body.messages, body.tools, body.tool_choice)
        elif isinstance(body, schema.CompletionRequest):  # a bare prompt: no structure to name a head by
            prompt, prefix = body.prompt_text, "cmpl"
        else:  # pragma: no cover - the two request kinds are all there is
            raise TypeError(type(body).__name__)
        if not prompt:
            raise InvalidField("prompt", "empty")
        # 0: not set: --default-max-output-tokens, else none (the engine caps it at the context)
        tokens = body.output_tokens() or self._request_limits.default_output_tokens
        param = body.output_tokens_param()
        if problem := self._request_limits.output_tokens_problem(param, tokens):  # --max-output-tokens
            raise InvalidField(param, problem.removeprefix(f"{param}: "))
        prefix_id, prefix_tokens = shared_prefix(head)
        return Call(
            call_id=f"{prefix}-{uuid.uuid4().hex}",
            model=body.model,
            prompt=prompt,
            max_tokens=tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            stop=tuple(body.stop_sequences),
            response_format_json=body.response_format_json,
            chat_json=chat,  # `prompt` is its generic rendering (token estimates, template-less models)
            prefix_id=prefix_id,
            prefix_tokens=prefix_tokens,
        )

    def _limits(self, tenant: str) -> TenantLimits:
        record = self._access.directory.tenant(tenant) if self._access.directory is not None else None
        return record.limits if record is not None else TenantLimits()

    # ----- one call ---------------------------------------------------------------------------

    async def call(
        self,
        who: Principal,
        identity: ProgramIdentity,
        call: Call,
        *,
        reader: ReplyReader | None = None,
        on_events: Callable[[list[ReplyEvent]], None] | None = None,
        parent: otel_context.Context | None = None,
    ) -> CallDone:
        """Run `call` as a hop of its program. Counted against the caller's tenant (whose
        program it is: two tenants may use the same program id); raises what the hop
        raised (TimeoutError, an InferxError), after recording it in the program.

        The reply is read by `reader` (`reader()`; none: content as it is) inside the
        call, so a reply that breaks its tool_choice (ToolChoiceNotFollowed) fails the
        call and is recorded so. With `on_events` the engine's text is streamed and
        what the reader makes of it (content, tool calls) is given as it comes."""
        limits = self._limits(who.tenant)
        try:
            self._quotas.admit(who.tenant, limits, int(identity.tier))
        except (TierNotAllowed, QuotaExceeded) as exc:
            metrics.TENANT_REFUSALS.labels(who.tenant, exc.limit).inc()
            raise
        # The hop's record: the tokens its engine used count against the tenant, a call
        # whose reply then failed (ToolChoiceNotFollowed) too.
        result = router_pb2.NodeFinished(model=call.model, node_type="model_inference")
        try:
            return await self._run(who, identity, call, reader or ReplyReader(), on_events, parent, result)
        finally:
            self._quotas.finished(
                who.tenant, limits, result.usage.prompt_tokens + result.usage.completion_tokens, result.cost
            )

    async def _run(
        self,
        who: Principal,
        identity: ProgramIdentity,
        call: Call,
        reader: ReplyReader,
        on_events: Callable[[list[ReplyEvent]], None] | None,
        parent: otel_context.Context | None,
        result: router_pb2.NodeFinished,
    ) -> CallDone:
        attributes = {
            "inferx.program_id": identity.program_id,
            "inferx.parent_program_id": identity.parent_program_id,
            "inferx.chain": identity.name,
            "inferx.tenant": who.tenant,
            "inferx.tier": identity.tier.label,
            "inferx.call_id": call.call_id,
        }
        with telemetry.span(f"program {identity.name}", attributes, parent=parent) as span:
            found = Continuation()
            shared = self.homes is not None and identity.program_id
            if shared and self.book.get(who.tenant, identity.program_id) is None:
                # New here (no etcd call: the mirror says), or held by another router.
                assert self.homes is not None
                found = await self.homes.arrive(who.tenant, identity.program_id)
            ticket = self.book.begin(
                identity,
                tenant=who.tenant,
                trace_id=telemetry.trace_id_of(span),
                first_hop_index=found.hop_index,
                continues_run_id=found.run_id,
            )
            if shared and ticket.opened and not ticket.last:
                assert self.homes is not None
                self.homes.opened(ticket.program)
            metrics.PROGRAMS_OPEN.set(len(self.book))
            span.set_attributes(
                {"inferx.run_id": ticket.program.run_id, "inferx.hop_index": ticket.hop_index}
            )
            try:
                done = await self._hop(call, ticket, identity, result, reader, on_events)
                if self.price_of is not None:  # what the call cost (inferx.pricing)
                    result.cost = costs.cost_of_hop(self.price_of(call.model), result, done.engine_ms / 1000)
                    done = dataclasses.replace(done, cost=result.cost)
            finally:
                ticket.program.finished.cost += result.cost
                self.book.finish(ticket, result)
                metrics.PROGRAMS_OPEN.set(len(self.book))
                kept = ticket.program.finished.hops[-1]
                result.latency_ms = kept.latency_ms
                result.node_id = kept.node_id
                metrics.observe_program_call(identity.name, who.tenant, result)
                telemetry.finish_node_span(span, result)
        return CallDone(
            call=call,
            done=done,
            run_id=ticket.program.run_id,
            program_id=identity.program_id,
            call_index=ticket.hop_index,
            latency_ms=result.latency_ms,
            reply=reader,
        )

    async def _hop(
        self,
        call: Call,
        ticket: Ticket,
        identity: ProgramIdentity,
        result: router_pb2.NodeFinished,
        reader: ReplyReader,
        on_events: Callable[[list[ReplyEvent]], None] | None,
    ) -> HopDone:
        hop, timeout_s = program_hop(
            call,
            ticket,
            identity,
            now_unix_ms=int(time.time() * 1000),
            default_timeout_ms=self._default_timeout_ms,
        )

        def dispatched(worker_id: str) -> None:
            result.worker_id = worker_id

        def text(piece: str) -> None:
            assert on_events is not None
            if events := reader.feed(piece):
                on_events(events)

        streamed = on_events is not None
        try:
            on_text = text if streamed else None
            done = await self._executor.run_hop(hop, timeout_s, dispatched, on_text=on_text)
        except TimeoutError:
            result.status, result.error = "timeout", f"timed out after {timeout_s * 1000:g}ms"
            raise
        except InferxError as exc:
            result.status, result.error = "error", exc.message
            raise
        except asyncio.CancelledError:
            result.status, result.error = "cancelled", "the caller went away"
            raise
        except Exception as exc:
            result.status, result.error = "error", f"internal error: {type(exc).__name__}"
            raise
        try:
            if not streamed:
                reader.feed(done.text)
            rest = reader.finish()
            result.reasoning = reader.reasoning or ""  # the record keeps the thinking apart
        except ToolChoiceNotFollowed as exc:  # the model ran; its reply fails the call
            result.status, result.error = "error", f"{exc.code_name}: {exc.message}"
            _fill(result, done)
            raise
        if rest and on_events is not None:
            on_events(rest)
        result.status = "ok"
        _fill(result, done)
        return done

    async def stream(
        self,
        who: Principal,
        identity: ProgramIdentity,
        call: Call,
        *,
        reader: ReplyReader | None = None,
        parent: otel_context.Context | None = None,
    ) -> AsyncGenerator[ReplyEvent | CallDone, None]:
        """What `reader` reads of the call's text as it is generated (content pieces,
        tool calls), then its CallDone. Errors of the hop are raised where they happen
        (before the first piece, or after some). Closing the iterator early (the caller
        went away) abandons the hop: the engine call is aborted."""
        pieces: asyncio.Queue[ReplyEvent | None] = asyncio.Queue()

        def put(events: list[ReplyEvent]) -> None:
            for event in events:
                pieces.put_nowait(event)

        task = asyncio.create_task(
            self.call(who, identity, call, reader=reader, on_events=put, parent=parent)
        )
        task.add_done_callback(lambda _task: pieces.put_nowait(None))
        try:
            while (piece := await pieces.get()) is not None:
                yield piece
            yield await task
        finally:
            if not task.done():
                task.cancel()  # recorded in the program as a cancelled call

    # ----- upkeep ---------------------------------------------------------------------------

    def _ended(self, program: Program) -> None:
        _observe_end(program)
        if self.homes is not None:
            self.homes.ended(program)

    def sweep(self) -> list[Program]:
        """End the programs idle past the book's idle time (see `programs`)."""
        ended = self.book.sweep()
        metrics.PROGRAMS_OPEN.set(len(self.book))
        return ended


def _fill(result: router_pb2.NodeFinished, done: HopDone) -> None:
    """A hop's record of what the engine did."""
    result.output = done.text
    result.worker_id = done.worker_id
    result.queue_ms = done.queue_ms
    result.usage.prompt_tokens = done.prompt_tokens
    result.usage.completion_tokens = done.completion_tokens
    result.usage.cached_prompt_tokens = done.cached_prompt_tokens


def _observe_end(program: Program) -> None:
    metrics.observe_program_end(program.name, program.tier, program.tenant, program.finished, program.ended)


# ----- Router.CallModel: the gRPC request as the HTTP front's body --------------------------

_CHOICES = ("auto", "none", "required")


def _json_field(param: str, text: str, kind: type) -> object:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidField(param, f"not valid JSON ({exc})") from None
    except RecursionError:
        raise InvalidField(param, "JSON nested too deeply") from None
    if not isinstance(value, kind):
        raise InvalidField(param, f"expected a JSON {'array' if kind is list else 'object'}")
    return value


def request_body(request: router_pb2.ProgramCallRequest) -> schema.CallRequest:
    """A CallModel request as the OpenAI body it stands for, validated the same way (so
    a bad field gets the same message, named as in the proto: `messages[0].role`)."""
    data: dict[str, Any] = {"model": request.model}
    if request.max_tokens:
        data["max_tokens"] = request.max_tokens
    if request.HasField("temperature"):
        data["temperature"] = round(request.temperature, 6)  # float32 on the wire
    if request.HasField("top_p"):
        data["top_p"] = round(request.top_p, 6)
    if request.HasField("seed"):
        data["seed"] = request.seed
    if request.stop:
        data["stop"] = list(request.stop)
    if request.response_format_json:
        data["response_format"] = _json_field("response_format_json", request.response_format_json, dict)
    if request.messages and request.prompt:
        raise InvalidField("prompt", "give a prompt or messages, not both")
    if not request.messages:
        for name in ("tools_json", "tool_choice_json"):
            if getattr(request, name):
                raise InvalidField(name, "only with messages")
        data["prompt"] = request.prompt
        return schema.validate_body(schema.CompletionRequest, data)
    messages = []
    for index, message in enumerate(request.messages):
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.name:
            item["name"] = message.name
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        if message.tool_calls_json:
            param = f"messages[{index}].tool_calls_json"
            item["tool_calls"] = _json_field(param, message.tool_calls_json, list)
        messages.append(item)
    data["messages"] = messages
    if request.tools_json:
        data["tools"] = _json_field("tools_json", request.tools_json, list)
    if request.tool_choice_json:
        choice = request.tool_choice_json.strip()
        data["tool_choice"] = choice if choice in _CHOICES else _json_field("tool_choice_json", choice, dict)
    return schema.validate_body(schema.ChatCompletionRequest, data)


def request_identity(
    request: router_pb2.ProgramCallRequest, time_remaining_s: float | None
) -> ProgramIdentity:
    """A CallModel request's program identity; without deadline_ms, the gRPC deadline
    (when the caller set one) is the call's."""
    deadline_ms = request.deadline_ms
    if not deadline_ms and time_remaining_s is not None:
        deadline_ms = max(1, min(int(time_remaining_s * 1000), MAX_DEADLINE_MS))
    return identity_of_fields(
        program_id=request.program_id,
        name=request.program_name,
        tier=int(request.tier),
        deadline_ms=deadline_ms,
        program_end=request.program_end,
        parent_program_id=request.parent_program_id,
        priority=request.priority,
        kv_retention_s=request.kv_retention_s if request.HasField("kv_retention_s") else None,
    )


def tool_call_message(call: ToolCall) -> router_pb2.ProgramToolCall:
    return router_pb2.ProgramToolCall(
        id=call.id, name=call.name, arguments_json=call.arguments, index=call.index
    )


def call_event(item: ReplyEvent | CallDone) -> router_pb2.ProgramCallEvent | None:
    """What `ProgramCalls.stream` gives, as CallModel's event: content as `text`, each
    tool call as soon as the reader has it whole as `tool_call` (as the HTTP front's SSE
    sends its tool_calls deltas), the result as `finished`. A held reply (tool_choice
    "required" or named) gives nothing before it has passed its check, so nothing sent
    here is ever refused later. None for empty content (nothing to send)."""
    if isinstance(item, Content):
        return router_pb2.ProgramCallEvent(text=item.text) if item.text else None
    if isinstance(item, ToolCall):
        return router_pb2.ProgramCallEvent(tool_call=tool_call_message(item))
    if isinstance(item, Reasoning):
        return router_pb2.ProgramCallEvent(reasoning=item.text) if item.text else None
    return finished_event(item)


def finished_event(result: CallDone) -> router_pb2.ProgramCallEvent:
    done = result.done
    return router_pb2.ProgramCallEvent(
        finished=router_pb2.ProgramCallFinished(
            usage=common_pb2.TokenUsage(
                prompt_tokens=done.prompt_tokens,
                completion_tokens=done.completion_tokens,
                cached_prompt_tokens=done.cached_prompt_tokens,
            ),
            finish_reason=schema.finish_reason(done.finish_reason, result.reply.called),
            worker_id=done.worker_id,
            run_id=result.run_id,
            program_id=result.program_id,
            call_index=result.call_index,
            queue_ms=done.queue_ms,
            latency_ms=result.latency_ms,
            tool_calls=[tool_call_message(call) for call in result.reply.calls],
            reasoning=result.reply.reasoning or "",
            cost=done.cost,
        )
    )
