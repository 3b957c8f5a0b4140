"""A trace's chains replayed as OpenAI-style agent programs over HTTP (`inferx bench
--peer`): the same client loop against any OpenAI-compatible front.

A chain (`inferx.sim.trace`) is one agent program: call k is a streamed `POST
/v1/chat/completions` whose messages are the previous call's messages, its completion
(an assistant message) and one new message -- the user's next turn for a chat, a tool
result for an agent -- sent when call k-1 has finished and its tool delay (or think
time) has passed. So the messages grow along the program as an agent framework's do,
and a worker that kept the program's context prefills only the new message. A DAG
chain (`research`: a plan, parallel search branches, a report) is a program whose
branches are in flight together, each extending the plan's conversation, and whose
join carries every branch it waits for (`Conversation`).

Sizes follow the trace exactly on the SIMULATED sim engine (4 characters a token): the
system message is the chain's shared prefix, and each new message is padded so that
the rendered prompt (`inferx.openai_compat.render`, what the worker and InferX's front
both render) has exactly the trace's prompt tokens and a whole number of tokens, so
"previous prompt + completion" is a prefix at token boundaries and the prefix cache
hits as it would on vLLM. The output length the trace prescribes reaches the engine
only, as the model's EOS would: the new message starts with `<|sim-eos N|>`
(`inferx_worker.engines.sim_engine`), which no router reads.

What each front is told, per call (`identity`), is only what a real client knows: the
program id (the chain id), its tier, and its deadline (arrival + SLO) -- never the
output length, the number of calls left or the tool delays:

  * `inferx`  X-InferX-Program, X-InferX-Tier, X-InferX-Deadline-Ms (no Program-End:
              a client does not know a call is its last until the model answers);
  * `session` X-Session-ID (vllm-router's consistent_hash key);
  * `agentic` vllm-router's program scheduling: the body's
              `vllm_xargs.agentic_context` {program_id, session_id, step_id, priority
              from the tier, deadline_seconds};
  * `none`    nothing (a direct call of a worker).

Time is compressed by `speed` as in the live replay (`inferx.bench.live`): workers run
`speed` times faster, arrivals and delays are divided by it, and every figure is
multiplied back (trace seconds). A call refused with 429/503 is retried after the
front's Retry-After; one cut at its deadline (a 504, or a `deadline_exceeded` error
event once the stream has started) is sent again without the deadline (the chain is
late either way; it goes on so that its latency is known). Every retry is counted in
`errors`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from inferx.bench.replay import replay_chains, run_calls
from inferx.openai_compat.render import render_chat
from inferx.openai_compat.schema import ChatMessage
from inferx.sim.profile import EngineProfile
from inferx.sim.records import ChainRecord
from inferx.sim.trace import ChainProgress, Trace, TraceChain

CHARS_PER_TOKEN = 4  # the sim engine's fixed-width tokens (inferx.bench.live too)
EOS_MARK = "<|sim-eos "  # inferx_worker.engines.sim_engine.EOS_MARK (a service: not imported)
_FILLER = (
    "the agent reads the file and runs the tests then calls the search tool with the "
    "query and writes the patch for the failing function before it checks the log "
)

Identity = Literal["inferx", "session", "agentic", "none", "inferx-end-marks", "inferx-no-deadline"]
# Diagnostics, never the benchmark's fronts: what InferX gets from an end mark on each
# program's last call (an ORACLE: a client learns that a call was its last only from
# its answer), and from no deadline header (its calls are then never cut).
DIAGNOSTICS: tuple[Identity, ...] = ("inferx-end-marks", "inferx-no-deadline")
# vllm-router's program scheduling resumes larger priorities first.
TIER_PRIORITY = {"realtime": 2, "standard": 1, "batch": 0}


@dataclass(frozen=True)
class Front:
    """One OpenAI-compatible endpoint and the identity its routing understands."""

    name: str
    base_url: str  # http://HOST:PORT (the API is under /v1)
    identity: Identity


def identity(
    identity: Identity, chain: TraceChain, k: int, deadline_left_s: float | None
) -> tuple[dict[str, str], dict[str, Any]]:
    """(headers, extra body fields) of call k for a front that understands `identity`.
    `deadline_left_s`: wall seconds to the chain's deadline (None or <= 0: none sent)."""
    left = deadline_left_s if deadline_left_s is not None and deadline_left_s > 0 else None
    if identity.startswith("inferx"):
        headers = {"X-InferX-Program": chain.chain_id, "X-InferX-Tier": chain.tier}
        if left is not None and identity != "inferx-no-deadline":
            headers["X-InferX-Deadline-Ms"] = str(max(1, int(left * 1000)))
        if identity == "inferx-end-marks" and k == len(chain.hops) - 1:
            headers["X-InferX-Program-End"] = "true"  # the oracle of this diagnostic
        return headers, {}
    if identity == "session":
        return {"X-Session-ID": chain.chain_id}, {}
    if identity == "agentic":
        context: dict[str, Any] = {
            "program_id": chain.chain_id,
            "session_id": chain.chain_id,
            "step_id": k,
            "priority": TIER_PRIORITY.get(chain.tier, 1),
        }
        if left is not None:
            context["deadline_seconds"] = round(left, 3)
        return {}, {"vllm_xargs": {"agentic_context": context}}
    return {}, {}


def piece(tag: str, chars: int) -> str:
    """`chars` characters of text that start with `tag` (cut to fit)."""
    body = f"[{tag}] " + _FILLER * (1 + chars // len(_FILLER))
    return body[:chars]


class Conversation:
    """One program's messages as the client keeps them, and their rendering length.

    Call k's messages are the system message, then each call it depends on
    (transitively, in index order: `TraceChain.ancestors`) as its new message and its
    completion, then call k's new message. For a sequence that is the previous call's
    messages + its completion + one new message; a DAG's branches each extend their
    parent's conversation, and a join carries every branch it waits for (what an agent
    framework sends after a parallel fan-out)."""

    def __init__(self, chain: TraceChain) -> None:
        self.chain = chain
        self._system: list[dict[str, Any]] = []
        self._asked: dict[int, dict[str, Any]] = {}  # call k's new message
        self._answered: dict[int, dict[str, Any]] = {}  # call k's completion
        if chain.shared_tokens:
            # The shared prefix (system prompt, tool specs) of the chain's kind: the same
            # text in every chain of the kind, so it is a cross-program cache hit.
            self._system.append(
                {"role": "system", "content": piece(f"system {chain.shared_prefix}", self._sys_chars())}
            )

    def _sys_chars(self) -> int:
        # "<|system|>\n" + content + "\n" renders the system message.
        return max(1, self.chain.shared_tokens * CHARS_PER_TOKEN - len("<|system|>\n\n"))

    def messages(self, k: int) -> list[dict[str, Any]]:
        """Call k's messages (its new message once `next_call(k)` made it)."""
        out = list(self._system)
        for j in self.chain.ancestors(k):
            out += [self._asked[j], self._answered[j]]
        if k in self._asked:
            out.append(self._asked[k])
        return out

    @staticmethod
    def rendered_chars(messages: list[dict[str, Any]]) -> int:
        return len(render_chat([ChatMessage.model_construct(**m) for m in messages]))

    def next_call(self, k: int) -> list[dict[str, Any]]:
        """Make call k's new message, sized so the rendered prompt has the trace's prompt
        tokens (or a little more, when the message's head alone is longer); its messages."""
        chain = self.chain
        hop = chain.hops[k]
        deps = chain.deps(k)
        role = "user" if not deps or chain.kind == "chat" else "tool"
        message: dict[str, Any] = {"role": role, "content": "x"}
        if role == "tool":
            message["tool_call_id"] = f"call_{deps[-1]}"
        self._asked[k] = message
        messages = self.messages(k)
        base = self.rendered_chars(messages) - 1
        target = chain.prompt_tokens(k) * CHARS_PER_TOKEN
        head = f"{EOS_MARK}{hop.output_tokens}|> "
        want = max(target - base, len(head) + 8)
        want += (-(base + want)) % CHARS_PER_TOKEN  # a whole number of tokens
        message["content"] = head + piece(f"{chain.chain_id} call {k}", want - len(head))
        return messages

    def completion(self, k: int, text: str) -> None:
        self._answered[k] = {"role": "assistant", "content": text}


def http_client(timeout_s: float) -> httpx.AsyncClient:
    """The benchmark's HTTP client: TCP_NODELAY, so a request's headers and body (two
    writes) do not wait on the server's delayed ACK (~40 ms on Linux per small call)."""
    transport = httpx.AsyncHTTPTransport(
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
    )
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout_s, connect=30.0))


@dataclass
class CallOutcome:
    text: str = ""
    ttft_s: float | None = None  # wall seconds from sending to the first text
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""  # '' = ok; else "http 429", "http 504", "transport: ...", ...
    retry_after_s: float | None = None


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> CallOutcome:
    """One streamed chat call: its text, TTFT, usage, or what went wrong."""
    outcome = CallOutcome()
    sent = time.perf_counter()
    texts: list[str] = []
    try:
        async with client.stream(
            "POST", url, content=json.dumps(body, separators=(",", ":")), headers=headers
        ) as response:
            if response.status_code != 200:
                await response.aread()
                outcome.error = f"http {response.status_code}"
                retry = response.headers.get("retry-after")
                if retry is not None:
                    try:
                        outcome.retry_after_s = float(retry)
                    except ValueError:
                        outcome.retry_after_s = 1.0
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    outcome.error = (
                        f"stream error: {event['error'].get('code') or event['error'].get('type')}"
                    )
                    return outcome
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if outcome.ttft_s is None:
                            outcome.ttft_s = time.perf_counter() - sent
                        texts.append(text)
                usage = event.get("usage")
                if usage:
                    outcome.prompt_tokens = usage.get("prompt_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    outcome.cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, ValueError) as exc:
        outcome.error = f"transport: {type(exc).__name__}"
        return outcome
    outcome.text = "".join(texts)
    return outcome


@dataclass
class ReplayStats:
    errors: dict[str, int] = field(default_factory=dict)  # retried or failed calls, by kind
    calls: int = 0

    def count(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1


class HttpAgentReplay:
    """The trace's chains as agent programs against one front, closed loop per chain."""

    MAX_ATTEMPTS = 20  # per call: retries of refused (429/503) and cut (504) calls

    def __init__(self, front: Front, trace: Trace, profile: EngineProfile, speed: float, model: str) -> None:
        self.front, self.trace, self.profile, self.speed, self.model = front, trace, profile, speed, model
        self.stats = ReplayStats()

    async def run(self, timeout_s: float, progress: Callable[[int], None]) -> list[ChainRecord]:
        async with http_client(timeout_s) as client:

            async def run_chain(chain: TraceChain, record: ChainRecord, start: float) -> None:
                await self._chain(client, chain, record, start)

            records, unfinished = await replay_chains(
                self.trace, self.profile, self.speed, timeout_s, progress, run_chain
            )
        for _ in range(unfinished):
            self.stats.count("unfinished at the timeout")
        return records

    async def _chain(
        self, client: httpx.AsyncClient, chain: TraceChain, record: ChainRecord, start: float
    ) -> None:
        """One program: each call is a task, sent when `ChainProgress` says it is ready
        (the calls it waits for finished, their tool delay or think time passed), so a
        DAG's branches are in flight together; the program ends when all calls did, or
        at the first that fails (the others are cancelled)."""
        loop = asyncio.get_running_loop()
        speed = self.speed
        arrival = start + chain.arrival_s / speed
        await asyncio.sleep(max(0.0, arrival - loop.time()))
        deadline = loop.time() + chain.slo_s / speed
        url = f"{self.front.base_url}/v1/chat/completions"
        conversation = Conversation(chain)

        async def call(k: int, ready_at: float) -> tuple[str | None, float]:
            """Call k sent at `ready_at` (loop time): (None, when it finished), or the
            chain's failure status."""
            await asyncio.sleep(max(0.0, ready_at - loop.time()))
            messages = conversation.next_call(k)
            outcome = await self._call(client, url, chain, k, messages, deadline)
            if outcome.error:
                self.stats.count(outcome.error)
                return "shed" if outcome.error in ("http 429", "http 503") else "failed", loop.time()
            if outcome.ttft_s is not None:
                record.ttft_s.append(outcome.ttft_s * speed)
            record.prompt_tokens += outcome.prompt_tokens
            record.cached_tokens += outcome.cached_tokens
            conversation.completion(k, outcome.text)
            return None, loop.time()

        failure, ended = await run_calls(ChainProgress(chain), arrival, speed, call)
        if failure is not None:
            record.finish(failure, 0.0)
        else:
            record.finish("ok", (ended - start) * speed)

    async def _call(
        self,
        client: httpx.AsyncClient,
        url: str,
        chain: TraceChain,
        k: int,
        messages: list[dict[str, Any]],
        deadline: float,
    ) -> CallOutcome:
        loop = asyncio.get_running_loop()
        send_deadline = True
        outcome = CallOutcome(error="not sent")
        for _ in range(self.MAX_ATTEMPTS):
            left = deadline - loop.time() if send_deadline else None
            headers, extra = identity(self.front.identity, chain, k, left)
            body = {
                "model": self.model,
                "messages": messages,
                "max_tokens": chain.max_tokens(k),  # the cap an agent sends, not the output length
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **extra,
            }
            headers["Content-Type"] = "application/json"
            self.stats.calls += 1
            outcome = await stream_chat(client, url, body, headers)
            if outcome.error in ("http 429", "http 503"):
                self.stats.count(f"{outcome.error} (retried)")
                await asyncio.sleep(min(outcome.retry_after_s or 1.0, 5.0))
                continue
            if outcome.error in ("http 504", "stream error: deadline_exceeded") and send_deadline:
                self.stats.count(f"{outcome.error} at the deadline (sent again without it)")
                send_deadline = False
                continue
            return outcome
        return outcome
