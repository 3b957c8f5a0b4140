"""Iteration-level model of a continuous-batching engine (vLLM V1 with chunked prefill).

Pure: no clock, no I/O. A driver calls `plan(max_steps)` to schedule the next
iteration(s), advances its clock by `plan.steps * plan.step_s` (or fewer steps when
something arrives meanwhile) and calls `commit(plan, steps, now)`. Both the
virtual-time simulator and the live `sim` worker drive this same model.

Each iteration:
  * running sequences in priority order each take one decode token or a prefill chunk
    from the step's token budget; when KV memory runs out for a decode, the lowest
    priority (then newest) running sequence is preempted (recompute, as vLLM does);
  * waiting sequences are admitted in priority order while there is budget, a free
    sequence slot and KV memory for their uncached prompt (prefix-cache hits are free);
  * the step costs `EngineProfile.step_ms(decodes, prefill tokens, context tokens)`.
A sequence is at most the KV pool long (vLLM's max_model_len, which vLLM will not start
with larger than its KV cache): a longer prompt is refused (`PromptTooLong`) and a reply
stops when the sequence fills the pool (finish reason "length"), as vLLM caps it.
With a host KV tier (`EngineProfile.host_kv_capacity_tokens`), prefix entries the GPU
evicts go to host memory (`inferx.sim.host_kv`); a request whose prefix is there is
admitted with room for it and first loads it back at `host_load_tokens_per_s`. The
copy runs beside compute (vLLM's offloading connector uses its own CUDA stream): the
request waits for it (one PCIe link, first come first served) and takes no part in
the steps meanwhile; the others do not wait.
Stretches of pure decoding with nothing to admit are planned as one multi-step plan
(the batch cannot change until a sequence finishes), which keeps simulation fast.
With every priority equal the order is arrival order: plain FCFS.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from inferx.errors import InvalidArgument
from inferx.sim.host_kv import HostKv
from inferx.sim.kv import KvPool, Segment
from inferx.sim.profile import EngineProfile, prefill_pairs


class PromptTooLong(InvalidArgument, ValueError):
    """A prompt that leaves no room in the engine's KV pool for a single reply token
    (vLLM refuses it too: longer than max_model_len)."""


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt: tuple[Segment, ...]
    output_tokens: int
    priority: int = 0  # lower runs first (vLLM's convention)
    # Cached (unpinned) when the request finishes, so the next hop of the chain hits.
    output_segments: tuple[Segment, ...] = ()
    # Engine state.
    seq: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_left: int = 0
    generated: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    loaded_tokens: int = 0  # prompt tokens loaded back from the host tier (first admission)
    load_left: int = 0  # tokens still to load from the host tier before it can run
    _held: list[str] = field(default_factory=list)
    _private: int = 0

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.seq)

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass
class Plan:
    steps: int
    step_s: float
    decodes: list[SimRequest]
    prefills: list[tuple[SimRequest, int]]
    loading: bool = False  # loads from the host tier progress during these steps

    @property
    def duration_s(self) -> float:
        return self.steps * self.step_s


@dataclass
class StepResult:
    tokens: dict[str, int]  # request_id -> tokens produced by this commit
    first_tokens: list[SimRequest]
    finished: list[SimRequest]


class EngineModel:
    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        host = HostKv(profile.host_kv_capacity_tokens) if profile.host_kv_capacity_tokens else None
        self.kv = KvPool(profile.kv_capacity_tokens, host)
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.preemptions = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.loaded_tokens_total = 0  # prompt tokens loaded back from the host tier
        self._seq = itertools.count()

    # ----- requests -------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        """Prompt + reply tokens one sequence may hold: the whole KV pool."""
        return self.kv.capacity

    def add(self, request: SimRequest) -> None:
        """Queue a request; its reply is cut to what the pool holds past its prompt.

        Without the cut a sequence outgrowing the pool preempts itself and can never be
        admitted again: at the head of the queue it blocked the engine for good (a
        coding trace on the 7B profile, ~111.6k-token contexts in a 111,616-token pool)."""
        prompt_tokens = sum(s.tokens for s in request.prompt)
        if prompt_tokens >= self.max_model_len:
            raise PromptTooLong(
                f"request {request.request_id}: a prompt of {prompt_tokens:,} tokens leaves no room for a "
                f"reply in this engine's KV pool of {self.max_model_len:,} tokens (its max_model_len)"
            )
        request.seq = next(self._seq)
        request.prompt_tokens = prompt_tokens
        request.output_tokens = min(request.output_tokens, self.max_model_len - prompt_tokens)
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        for group in (self.waiting, self.running):
            for request in group:
                if request.request_id == request_id:
                    group.remove(request)
                    self._free(request)
                    return True
        return False

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ----- scheduling -----------------------------------------------------------------

    def plan(self, max_steps: int = 1 << 30) -> Plan | None:
        """Schedule the next iteration (or a stretch of identical decode iterations)."""
        budget = self.profile.max_batched_tokens
        decodes: list[SimRequest] = []
        prefills: list[tuple[SimRequest, int]] = []
        self.running.sort(key=lambda r: r.order)
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted below to make room for a more important one
            if budget <= 0:
                break
            if request.load_left > 0:
                continue  # its prefix is still on the way from the host tier
            if request.prefill_left > 0:
                chunk = min(request.prefill_left, budget)
                prefills.append((request, chunk))
                budget -= chunk
                continue
            # A decode needs one more token of KV; preempt from the back if memory is out.
            while not self.kv.make_room(len(decodes) + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
                decodes = [d for d in decodes if d is not victim]
                prefills = [(r, c) for r, c in prefills if r is not victim]
            if request in self.running:
                decodes.append(request)
                budget -= 1
        self.waiting.sort(key=lambda r: r.order)
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            request = self.waiting[0]
            if not self._admit(request, reserve=len(decodes)):
                break
            self.waiting.pop(0)
            self.running.append(request)
            if request.load_left > 0:
                continue
            chunk = min(request.prefill_left, budget)
            prefills.append((request, chunk))
            budget -= chunk
        load_s = self._next_load_s()
        if not decodes and not prefills:
            if load_s is None:
                return None
            # Only loads under way: wait for the first to land, in decode-step-sized
            # steps so that a request arriving meanwhile joins at the next one.
            steps = max(1, math.ceil(load_s * 1000 / self.profile.decode_step_ms))
            return Plan(min(steps, max_steps), load_s / steps, [], [], loading=True)
        steps = 1
        if not prefills:
            # Nothing can change until a sequence finishes (waiting ones are blocked on
            # slots or memory, which only a finish frees): plan the stretch at once.
            remaining = min(r.output_tokens - r.generated for r in decodes)
            memory = self.kv.available // len(decodes)
            steps = max(1, min(remaining, memory, max_steps))
        context = sum(r.context_tokens for r in decodes) + len(decodes) * (steps - 1) // 2
        prefill_tokens = sum(chunk for _, chunk in prefills)
        pairs = sum(
            prefill_pairs(r.prompt_tokens + r.generated - r.prefill_left, chunk) for r, chunk in prefills
        )
        step_ms = self.profile.step_ms(len(decodes), prefill_tokens, context, pairs)
        if load_s is not None and steps > 1:
            # ... or until the first load lands, when the request that waits on it joins.
            steps = max(1, min(steps, math.ceil(load_s * 1000 / step_ms)))
        return Plan(steps, step_ms / 1000, decodes, prefills, loading=load_s is not None)

    def _loading(self) -> list[SimRequest]:
        """Requests waiting on a load from the host tier, first admitted first."""
        return sorted((r for r in self.running if r.load_left > 0), key=lambda r: r.seq)

    def _next_load_s(self) -> float | None:
        """Seconds until the first load under way lands; None when none is."""
        if self.kv.host is None:
            return None
        loading = self._loading()
        if not loading:
            return None
        return loading[0].load_left / self.profile.host_load_tokens_per_s

    def _advance_loads(self, seconds: float) -> None:
        """The PCIe link moves `seconds` worth of tokens, to the loads in arrival order."""
        budget = seconds * self.profile.host_load_tokens_per_s
        for request in self._loading():
            if budget <= 0:
                break
            moved = min(request.load_left, math.ceil(budget - 1e-6))
            request.load_left -= moved
            budget -= moved

    def commit(self, plan: Plan, steps: int, now: float) -> StepResult:
        """Apply `steps` (<= plan.steps) iterations of `plan`, ending at time `now`."""
        steps = max(1, min(steps, plan.steps))
        tokens: dict[str, int] = {}
        first: list[SimRequest] = []
        done: list[SimRequest] = []
        if plan.loading:
            self._advance_loads(steps * plan.step_s)
        if plan.decodes:
            self.kv.make_room(len(plan.decodes) * steps)
        for request in plan.decodes:
            if request not in self.running:
                continue
            request.generated += steps
            request._private += steps
            self.kv.alloc_private(steps)
            tokens[request.request_id] = steps
            if request.generated >= request.output_tokens:
                done.append(request)
        for request, chunk in plan.prefills:
            if request not in self.running:
                continue
            request.prefill_left -= chunk
            if request.prefill_left == 0:
                # The iteration that completes the prefill also samples the first token.
                request.generated += 1
                if request.first_token_at is None:
                    request.first_token_at = now
                    first.append(request)
                tokens[request.request_id] = 1
                if request.generated >= request.output_tokens:
                    done.append(request)
        for request in done:
            self.running.remove(request)
            request.finished_at = now
            self._finish(request)
        return StepResult(tokens, first, done)

    # ----- memory ---------------------------------------------------------------------

    def _admit(self, request: SimRequest, reserve: int) -> bool:
        """Pin the cached prefix, allocate the rest; False (nothing held) if it won't fit."""
        prefix: list[str] = []  # the usable prefix: cached on the GPU or in the host tier
        hits: list[str] = []  # ... of which on the GPU (pinned now)
        loads: list[Segment] = []  # ... of which to load back from the host tier
        cached = 0
        host = self.kv.host
        for segment in request.prompt:
            if segment.key is None:
                break
            if segment.key in self.kv:
                self.kv.acquire(segment.key)
                hits.append(segment.key)
                cached += segment.tokens
            elif host is not None and segment.key in host:
                # Out of the host tier before making room: what make_room evicts to the
                # host below must not push these out.
                loads.append(Segment(segment.key, host.take(segment.key)))
            else:
                break
            prefix.append(segment.key)
        rest = request.prompt[len(prefix) :]
        loaded = sum(s.tokens for s in loads)
        # Cached, but after a miss: not usable as a prefix; recompute into it. Pinned
        # before making room, or make_room may evict them and the inserts below would
        # then overcommit the pool.
        reused = [s.key for s in rest if s.key is not None and s.key in self.kv]
        for key in reused:
            self.kv.acquire(key)
        need = sum(s.tokens for s in rest if s.key is None or s.key not in self.kv)
        need += request.generated + reserve  # recompute after preemption; room for decodes
        if not self.kv.make_room(need + loaded):
            for key in reversed(hits + reused):
                self.kv.release(key)
            for segment in loads:
                assert host is not None and segment.key is not None
                host.store(segment.key, segment.tokens)
            return False
        for segment in loads:
            assert segment.key is not None
            self.kv.insert(segment.key, segment.tokens, pinned=True)
        held = list(prefix)
        private = request.generated
        for segment in rest:
            if segment.key is None:
                private += segment.tokens
            elif segment.key in reused:
                held.append(segment.key)
            else:
                self.kv.insert(segment.key, segment.tokens, pinned=True)
                held.append(segment.key)
        self.kv.alloc_private(private)
        request._held, request._private = held, private
        # The last prompt token is always computed: its logits give the first token.
        uncached = request.prompt_tokens - cached - loaded
        request.prefill_left = max(1, uncached + request.generated)
        request.load_left = loaded
        if request.preemptions == 0:
            request.cached_tokens = cached
            request.loaded_tokens = loaded
            self.prompt_tokens_total += request.prompt_tokens
            self.cached_tokens_total += cached
            self.loaded_tokens_total += loaded
        return True

    def _free(self, request: SimRequest) -> None:
        # Tail first, as vLLM frees a request's blocks (KVCacheManager.free): under memory
        # pressure LRU then evicts the end of a cached prefix before its head, so the
        # shorter prefix stays usable. Releasing head first evicted a chain's first
        # segment first, which made every later segment of it useless.
        for key in reversed(request._held):
            self.kv.release(key)
        self.kv.free_private(request._private)
        request._held, request._private = [], 0

    def _finish(self, request: SimRequest) -> None:
        """A finished request: its output becomes a cached segment (the tail, so it is
        evicted first), then its prompt segments are released tail first."""
        self.kv.free_private(request._private)
        request._private = 0
        self._cache_output(request)
        self._free(request)

    def _preempt(self, request: SimRequest) -> None:
        self.running.remove(request)
        self._free(request)
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.append(request)

    def _cache_output(self, request: SimRequest) -> None:
        for segment in request.output_segments:
            if segment.key is None or segment.key in self.kv:
                continue
            if not self.kv.make_room(segment.tokens):
                break
            self.kv.insert(segment.key, segment.tokens, pinned=False)
