"""`sim`: a SIMULATED continuous-batching GPU engine. It runs no model. It exists for
benchmarks and fast tests and is only used when asked for with `--engine sim`; it is
never chosen silently.

It drives the same iteration-level model as the virtual-time simulator
(`inferx.sim.engine.EngineModel`, calibrated by `inferx.sim.profile.EngineProfile`:
Vidur's Llama-3-8B/A100 profile by default), against the wall clock:

  * a prompt is cut into fixed-width "tokens" (`chars_per_token` characters), grouped
    into blocks of `block_size` tokens keyed by a running hash of everything before
    them, as vLLM's automatic prefix caching does; a request's cached prefix is the
    run of leading blocks still in the KV pool (LRU over freed blocks);
  * each engine iteration schedules decodes and chunked prefills under a token
    budget, preempts when KV runs out, and costs `EngineProfile.step_ms(...)`;
  * every generated token is exactly `chars_per_token` characters, and finished
    sequences leave their prompt + output blocks in the cache, so a client that sends
    "previous prompt + completion + new input" hits the prefix as on vLLM;
  * the completion has `max_tokens` tokens, unless the prompt says where the "model"
    stops: the LAST `<|sim-eos N|>` in the prompt ends it after N tokens (finish
    reason "stop"), as a real model's EOS would. Replays put it in a call's newest
    message, so every front and router in between sees only a request's `max_tokens`
    cap, never the output length (no oracle input to a scheduler). A request that sets
    no `max_tokens` (up to the context room, as on vLLM) and has no `<|sim-eos N|>`
    stops after `UNSET_REPLY_TOKENS` (finish reason "stop"): a synthetic "model" has
    nothing to say, and generating until its whole KV pool is full would help no test.

Chats (the OpenAI front's calls) are rendered with the chat template of the model
directory given as `--model-path`, when it has one, as a vLLM worker of that model
renders them; otherwise the worker runs InferX's generic rendering. With `--sim-script`
(inferx.sim.script, SIMULATED replies), a prompt a rule matches gets the rule's reply
instead of the synthetic text, cut into tokens the same way (its last token may be
shorter) and produced at the same simulated speed; it ends with finish reason "stop"
when the whole reply fits in max_tokens.

Engine time runs `speed` times faster than the wall clock. The loop keeps an engine
clock and sleeps until each iteration's end on it; when the process lags, iterations
run back to back until the clock has caught up, so the simulated throughput does not
depend on how busy the host is (as long as it keeps up on average).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from inferx_worker.engines.registry import register_engine

if TYPE_CHECKING:
    from inferx_worker.config import WorkerSettings

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from prometheus_client import Counter

from inferx.chat_template import Chat, ChatTemplate
from inferx.sim.engine import EngineModel, PromptTooLong, SimRequest
from inferx.sim.kv import Segment
from inferx.sim.profile import EngineProfile
from inferx.sim.script import SimScript
from inferx_worker.engines.base import (
    Engine,
    EngineCapacity,
    EngineChunk,
    EngineCounters,
    EngineError,
    EngineLoad,
    EngineRequest,
)
from inferx_worker.kv_events import KvEventHub

log = logging.getLogger("inferx.worker.sim")

PREEMPTIONS = Counter("inferx_sim_preemptions_total", "Sequences preempted by the SIMULATED engine")

# Generated text cycles through this string in `chars_per_token`-wide tokens.
_TEXT = (
    "order shipping refund account agent support delivery status tracking update "
    "customer request answer policy invoice package warehouse courier return item "
)


@dataclass(frozen=True)
class SimParams:
    profile: EngineProfile = field(default_factory=EngineProfile)
    speed: float = 1.0
    chars_per_token: int = 4
    max_steps_per_iteration: int = 16  # decode stretches are streamed in chunks this long
    prefix_caching: bool = True  # off: no block is ever shared or kept (A/B benchmarks)

    @classmethod
    def with_overrides(cls, profile: EngineProfile | None = None, **overrides: object) -> SimParams:
        """`overrides` may hold `speed`, `chars_per_token`, and any EngineProfile key;
        None values are ignored."""
        mine = ("speed", "chars_per_token", "prefix_caching")
        own = {k: v for k, v in overrides.items() if k in mine and v is not None}
        prof = {k: v for k, v in overrides.items() if k not in own and v is not None}
        base = profile or EngineProfile()
        return cls(profile=base.model_copy(update=prof) if prof else base, **own)  # type: ignore[arg-type]


EOS_MARK = "<|sim-eos "
# What the "model" says when nothing bounds it (no max_tokens, no <|sim-eos N|>).
UNSET_REPLY_TOKENS = 64


def eos_directive(tokens: int) -> str:
    """The text that makes the sim engine stop after `tokens` tokens."""
    return f"{EOS_MARK}{tokens}|>"


def eos_after(prompt: str) -> int | None:
    """N of the last `<|sim-eos N|>` in `prompt` (None: there is none, or N is not a
    positive whole number)."""
    at = prompt.rfind(EOS_MARK)
    if at < 0:
        return None
    start = at + len(EOS_MARK)
    end = prompt.find("|>", start, start + 12)
    digits = prompt[start:end] if end >= 0 else ""
    return int(digits) if digits.isdigit() and int(digits) > 0 else None


def split_tokens(text: str, chars_per_token: int) -> list[str]:
    """Fixed-width "tokens" keep prefix matching exact and cheap."""
    width = max(1, chars_per_token)
    return [text[i : i + width] for i in range(0, len(text), width)]


def output_tokens(start: int, count: int, chars_per_token: int) -> list[str]:
    """`count` generated tokens, each exactly `chars_per_token` characters; the text
    depends only on `start` (the prompt length), so runs are deterministic."""
    width = max(1, chars_per_token)
    base = (start * 7) % len(_TEXT)
    doubled = _TEXT * (2 + (count * width) // len(_TEXT))
    text = doubled[base : base + count * width]
    return [text[i : i + width] for i in range(0, count * width, width)]


def stop_at(out: list[str], stops: tuple[str, ...]) -> tuple[int, int] | None:
    """Where output tokens `out` stop at the first of `stops` they write: (tokens
    generated, through the one completing it; characters shown, before it); None when
    they write none."""
    if not stops:
        return None
    text = "".join(out)
    found = [(text.find(stop), stop) for stop in stops if stop and stop in text]
    if not found:
        return None
    start, stop = min(found, key=lambda hit: (hit[0] + len(hit[1]), hit[0]))
    end, tokens = start + len(stop), 0
    for size in itertools.accumulate(len(token) for token in out):
        tokens += 1
        if size >= end:
            break
    return tokens, start


def block_segments(tokens: list[str], block_size: int, first: int = 0) -> list[Segment]:
    """One segment per whole block, keyed by a running hash of all tokens before its
    end; a trailing partial block is private (key None). Only segments from block
    `first` on are returned (the hash still covers everything before them)."""
    digest = hashlib.sha1()
    segments: list[Segment] = []
    whole = len(tokens) // block_size
    for b in range(whole):
        digest.update("".join(tokens[b * block_size : (b + 1) * block_size]).encode())
        if b >= first:
            segments.append(Segment(digest.hexdigest(), block_size))
    tail = len(tokens) - whole * block_size
    if tail and first <= whole:
        segments.append(Segment(None, tail))
    return segments


class SimEngine(Engine):
    name = "sim"

    def __init__(
        self,
        params: SimParams | None = None,
        model_path: str = "sim",
        *,
        chat_template: ChatTemplate | None = None,
        script: SimScript | None = None,
    ) -> None:
        self.params = params or SimParams()
        self.model_path = model_path
        self.chat_template = chat_template
        self.script = script
        self.model = EngineModel(self.params.profile)
        # The cache's stores and evictions, as vLLM's KV events report them.
        self.hub = KvEventHub()
        self.model.kv.listener = self.hub
        self._streams: dict[str, asyncio.Queue[tuple[int, bool]]] = {}
        self._kick: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._origin = 0.0
        self.generated_tokens = 0

    # ----- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._kick = asyncio.Event()
            self._origin = asyncio.get_running_loop().time()
            self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        m = self.model
        log.info(
            "sim engine stats: preemptions=%d prompt_tokens=%d cached_prompt_tokens=%d",
            m.preemptions,
            m.prompt_tokens_total,
            m.cached_tokens_total,
        )

    def capacity(self) -> EngineCapacity:
        p = self.params.profile
        host = p.host_kv_capacity_tokens
        rate = p.host_load_tokens_per_s if host else 0.0
        return EngineCapacity(p.kv_capacity_tokens, p.max_num_seqs, p.block_size, host, rate)

    def load(self) -> EngineLoad:
        m = self.model
        return EngineLoad(len(m.running), len(m.waiting), min(1.0, m.kv.pinned / m.kv.capacity))

    def counters(self) -> EngineCounters:
        m = self.model
        return EngineCounters(
            prompt_tokens=m.prompt_tokens_total,
            cached_prompt_tokens=m.cached_tokens_total,
            generation_tokens=self.generated_tokens,
            preemptions=m.preemptions,
        )

    @property
    def started(self) -> bool:
        return self._task is not None and not self._task.done()

    def count_tokens(self, prompt: str) -> int:
        return max(1, math.ceil(len(prompt) / max(1, self.params.chars_per_token)))

    def kv_events(self) -> KvEventHub:
        return self.hub

    def chat_template_source(self) -> str | None:
        return None if self.chat_template is None else self.chat_template.source

    def render_chat(self, chat: Chat) -> str | None:
        if self.chat_template is None:
            return None
        return self.chat_template.render(chat.messages, tools=chat.tools)

    def step_ms(self, batch: int) -> float:
        """A pure decode step of `batch` sequences (no context reads)."""
        return self.params.profile.decode_ms(batch)

    # ----- the engine loop --------------------------------------------------------------

    def _engine_now(self) -> float:
        return (asyncio.get_running_loop().time() - self._origin) * self.params.speed

    async def _sleep_until(self, engine_t: float) -> None:
        delay = (engine_t - self._engine_now()) / self.params.speed
        if delay > 0:
            await asyncio.sleep(delay)

    async def _run(self) -> None:
        assert self._kick is not None
        clock = 0.0
        while True:
            plan = self.model.plan(self.params.max_steps_per_iteration)
            if plan is None:
                self._kick.clear()
                await self._kick.wait()
                clock = max(clock, self._engine_now())  # idle time passes at once
                continue
            self._kick.clear()
            steps = plan.steps
            end = clock + plan.duration_s
            delay = (end - self._engine_now()) / self.params.speed
            if delay > 0 and steps > 1:
                # asyncio.wait, not wait_for: wait_for (3.11) may swallow a cancel.
                waiter = asyncio.ensure_future(self._kick.wait())
                try:
                    await asyncio.wait({waiter}, timeout=delay)
                finally:
                    waiter.cancel()
                if self._kick.is_set():
                    # A newcomer: stop the decode stretch at the step in progress.
                    elapsed = self._engine_now() - clock
                    steps = min(steps, max(1, math.ceil(elapsed / plan.step_s)))
                    end = clock + steps * plan.step_s
                    await self._sleep_until(end)
            elif delay > 0:
                await asyncio.sleep(delay)
            clock = end
            before = self.model.preemptions
            result = self.model.commit(plan, steps, clock)
            PREEMPTIONS.inc(self.model.preemptions - before)
            finished = {r.request_id for r in result.finished}
            self.generated_tokens += sum(result.tokens.values())
            for request_id, count in result.tokens.items():
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put_nowait((count, request_id in finished))

    # ----- requests ---------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineChunk, None]:
        assert self._kick is not None, "start() first"
        p = self.params
        block = p.profile.block_size
        tokens = split_tokens(request.prompt, p.chars_per_token)
        # Up to the context room, the KV pool here (vLLM stops a reply at max_model_len).
        room = p.profile.kv_capacity_tokens - len(tokens)
        if room < 1:
            too_long = PromptTooLong(
                f"the prompt has {len(tokens):,} tokens; this engine's max_model_len (its KV pool) is "
                f"{p.profile.kv_capacity_tokens:,}: no room for a reply"
            )
            raise EngineError(str(too_long)) from too_long
        wanted = room if request.max_tokens is None else max(1, min(request.max_tokens, room))
        scripted = self.script.reply(request.prompt) if self.script is not None else None
        if scripted is not None:
            out = split_tokens(scripted, p.chars_per_token)[:wanted]
            reason = "stop" if "".join(out) == scripted else "length"
            wanted = len(out)
        else:
            eos = eos_after(request.prompt)  # a replay's <|sim-eos N|>: the "model" stops after N tokens
            if eos is None and request.max_tokens is None:
                eos = UNSET_REPLY_TOKENS
            reason = "stop" if eos is not None and eos < wanted else "length"
            if eos is not None:
                wanted = min(wanted, eos)
            out = output_tokens(len(tokens), wanted, p.chars_per_token)
        # Stop sequences: the "model" stops at the token that completes the first one it
        # writes; the text shown ends before it (as vLLM's detokenizer cuts it).
        full = "".join(out)
        shown = len(full)
        if (stopped := stop_at(out, request.stop)) is not None:
            wanted, shown = stopped
            out, reason = out[:wanted], "stop"
        ends = [0, *itertools.accumulate(len(token) for token in out)]  # token i ends at ends[i + 1]
        if p.prefix_caching:
            prompt_segments = block_segments(tokens, block)
            # Blocks completed by the output (from the prompt's partial block on) stay cached.
            output_segments = [s for s in block_segments(tokens + out, block, len(tokens) // block) if s.key]
        else:
            prompt_segments, output_segments = [Segment(None, len(tokens))], []
        sim = SimRequest(
            request.request_id,
            tuple(prompt_segments),
            wanted,
            priority=request.priority,
            output_segments=tuple(output_segments),
        )
        stream: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
        self._streams[request.request_id] = stream
        self.model.add(sim)
        self._kick.set()
        produced, done = 0, False
        written = 0  # characters of the output sent so far (at most `shown`)
        try:
            while True:
                count, done = await stream.get()
                produced += count
                upto = min(shown, ends[min(produced, len(out))])
                text, written = full[written:upto], upto
                if done:
                    break
                yield EngineChunk(text=text)
            # The last step's text rides on the finished chunk, as vLLM's final output
            # carries its last token: one message fewer per call on every stream it crosses.
            yield EngineChunk(
                text=text,
                finished=True,
                finish_reason=reason,
                prompt_tokens=len(tokens),
                completion_tokens=produced,
                cached_prompt_tokens=sim.cached_tokens,
                context_blocks=tuple(
                    (seg.key, seg.tokens) for seg in (*prompt_segments, *output_segments) if seg.key
                )
                if request.context_blocks
                else (),
            )
        finally:
            self._streams.pop(request.request_id, None)
            if not done:
                self.model.abort(request.request_id)
                self._kick.set()


@register_engine(
    "sim",
    summary="SIMULATED: the latency model of a GPU engine, for benchmarks and fast tests",
    simulated=True,
)
def from_settings(settings: WorkerSettings) -> SimEngine:
    from inferx.sim.profile import load_profile

    log.warning("engine 'sim' is SIMULATED: latency model only, no model runs")
    template = ChatTemplate.from_model_dir(Path(settings.model_path))
    if template is not None:
        log.info("sim: chats are rendered with the chat template of %s", template.origin)
    else:
        log.warning(
            "sim: %s has no chat template: chats run InferX's generic rendering "
            '(inferx_worker_chat_renders_total{template="generic"})',
            settings.model_path,
        )
    script = SimScript.load(settings.sim_script) if settings.sim_script else None
    if script is not None:
        log.warning("sim: SIMULATED replies from %s (%d rules)", script.origin, len(script.rules))
    return SimEngine(
        SimParams.with_overrides(
            load_profile(settings.sim_profile),
            speed=settings.sim_speed,
            prefix_caching=settings.prefix_caching,
            decode_step_ms=settings.sim_decode_step_ms,
            prefill_tokens_per_s=settings.sim_prefill_tokens_per_s,
            max_num_seqs=settings.max_num_seqs,
            kv_capacity_tokens=settings.sim_kv_capacity_tokens,
        ),
        chat_template=template,
        script=script,
    )
