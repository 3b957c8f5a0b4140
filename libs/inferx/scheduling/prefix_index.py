"""Where each prefix block sits: an index fed by the engines' KV events, as llm-d's
precise prefix-cache scorer keeps one (llm-d-kv-cache-manager's `kvblock.Index`).

Pure: no I/O, no clock. Workers report three kinds of event (`KvEvent`): blocks
*stored* in their prefix cache, blocks *removed* (evicted), and *cleared* (the whole
cache dropped, or the stream restarted: the worker's next events describe it from
scratch). The index answers "how many leading tokens of this prompt does worker W
hold", for a prompt given as its sequence of block keys.

Block keys. A key names a block's tokens *and everything before them* (a chained
hash), so equal keys mean equal prefixes and a prompt's cached prefix is its longest
run of leading keys the worker holds. Keys are opaque strings here; whoever emits the
events and whoever describes prompts must key blocks the same way:
  * the simulator keys its segments by content (`inferx.sim.cluster.hop_segments`);
  * the live `sim` engine keys 16-token blocks by a running SHA-1 of their text;
  * for vLLM the worker re-keys vLLM's events with `chain_keys` over the events'
    token ids (vLLM's own block hashes depend on its hash function and seed, which
    the scheduler should not have to reproduce), exactly as llm-d does.
A block also carries its size in tokens (segments of the simulator differ in size).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Block = tuple[str, int]  # (key, tokens)
EventKind = Literal["stored", "removed", "cleared"]

STORED: Literal["stored"] = "stored"
REMOVED: Literal["removed"] = "removed"
CLEARED: Literal["cleared"] = "cleared"


@dataclass(frozen=True)
class KvEvent:
    """One worker's cache change. `blocks` (stored) carry their sizes; for removed
    events the sizes are not needed (0)."""

    kind: EventKind
    blocks: tuple[Block, ...] = ()


def chain_keys(token_ids: Sequence[int], block_size: int, parent: str | None = None) -> list[str]:
    """Keys of the whole `block_size`-token blocks of `token_ids`, each chained on the
    key before it (`parent` for the first): what the worker keys vLLM's blocks by and
    what a prompt's blocks are keyed by. A trailing partial block has no key (engines
    cache whole blocks only). Stable across processes (no Python `hash`)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    keys: list[str] = []
    previous = (parent or "").encode()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b"|")
        digest.update(b",".join(str(t).encode() for t in token_ids[start : start + block_size]))
        previous = digest.hexdigest().encode()
        keys.append(previous.decode())
    return keys


@dataclass
class _WorkerBlocks:
    """A worker's blocks and their sizes, with the running total of their tokens: the
    scheduler's status reports it for every worker, twice a second (the router's load
    poll), so it is kept as events arrive rather than summed over every block held
    (tens of thousands per engine) at each ask."""

    keys: dict[str, int] = field(default_factory=dict)  # key -> tokens
    tokens: int = 0


class PrefixIndex:
    """block key -> the workers that hold it (and its size in tokens)."""

    def __init__(self) -> None:
        self._holders: dict[str, set[str]] = {}
        self._workers: dict[str, _WorkerBlocks] = {}
        self.events = 0  # applied so far (observability, tests)

    # ----- events -----------------------------------------------------------------------

    def apply(self, worker_id: str, event: KvEvent) -> None:
        self.events += 1
        if event.kind == STORED:
            self.stored(worker_id, event.blocks)
        elif event.kind == REMOVED:
            self.removed(worker_id, (key for key, _ in event.blocks))
        elif event.kind == CLEARED:
            self.cleared(worker_id)
        else:
            raise ValueError(f"unknown KV event kind {event.kind!r}")

    def stored(self, worker_id: str, blocks: Iterable[Block]) -> None:
        worker = self._worker(worker_id)
        held = worker.keys
        for key, tokens in blocks:
            worker.tokens += tokens - held.get(key, 0)  # stored again: counted once
            held[key] = tokens
            self._holders.setdefault(key, set()).add(worker_id)

    def removed(self, worker_id: str, keys: Iterable[str]) -> None:
        worker = self._worker(worker_id)
        held = worker.keys
        for key in keys:
            tokens = held.pop(key, None)
            if tokens is not None:
                worker.tokens -= tokens
                self._drop(key, worker_id)

    def cleared(self, worker_id: str) -> None:
        """The worker's cache is empty (or about to be described again from scratch).
        The worker stays known: it reports events, it just holds nothing."""
        blocks = self._worker(worker_id)
        for key in blocks.keys:
            self._drop(key, worker_id)
        blocks.keys = {}
        blocks.tokens = 0

    def forget(self, worker_id: str) -> None:
        """The worker's event stream is gone: what it holds is unknown again (policies
        fall back to their estimates for it)."""
        if worker_id in self._workers:
            self.cleared(worker_id)
            del self._workers[worker_id]

    # ----- queries ----------------------------------------------------------------------

    def knows(self, worker_id: str) -> bool:
        """Events from this worker are being received: its answers are exact."""
        return worker_id in self._workers

    def match(self, worker_id: str, blocks: Sequence[Block]) -> int:
        """Tokens of the prompt (its leading `blocks`) the worker holds from the start:
        the sum of the sizes of its longest run of leading held blocks."""
        held = self._workers.get(worker_id)
        if held is None:
            return 0
        tokens = 0
        for key, size in blocks:
            if key not in held.keys:
                break
            tokens += size
        return tokens

    def holders(self, key: str) -> frozenset[str]:
        return frozenset(self._holders.get(key, ()))

    def blocks_of(self, worker_id: str) -> int:
        held = self._workers.get(worker_id)
        return len(held.keys) if held is not None else 0

    def tokens_of(self, worker_id: str) -> int:
        held = self._workers.get(worker_id)
        return held.tokens if held is not None else 0

    # ----- internals --------------------------------------------------------------------

    def _worker(self, worker_id: str) -> _WorkerBlocks:
        blocks = self._workers.get(worker_id)
        if blocks is None:
            blocks = self._workers[worker_id] = _WorkerBlocks()
        return blocks

    def _drop(self, key: str, worker_id: str) -> None:
        holders = self._holders.get(key)
        if holders is None:
            return
        holders.discard(worker_id)
        if not holders:
            del self._holders[key]


class EngineKeyMap:
    """Re-keys one engine's block events (vLLM's hashes + token ids, parent hash) into
    `chain_keys` keys, as llm-d maps engine keys to its request keys. Per worker: an
    engine hash is only meaningful to the engine that made it. A stored event whose
    parent is unknown (its store was missed) cannot be chained: it is dropped, with
    its descendants, until the engine stores that prefix again."""

    def __init__(self) -> None:
        self._keys: dict[object, str] = {}  # engine hash -> our key

    def stored(
        self,
        engine_hashes: Sequence[object],
        parent_hash: object | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> KvEvent | None:
        parent: str | None = None
        if parent_hash is not None:
            found = self._keys.get(parent_hash)
            if found is None:
                return None
            parent = found
        keys = chain_keys(token_ids, block_size, parent)[: len(engine_hashes)]
        for engine_hash, key in zip(engine_hashes, keys, strict=False):
            self._keys[engine_hash] = key
        return KvEvent(STORED, tuple((key, block_size) for key in keys))

    def removed(self, engine_hashes: Sequence[object]) -> KvEvent | None:
        keys = [self._keys.pop(h) for h in engine_hashes if h in self._keys]
        return KvEvent(REMOVED, tuple((key, 0) for key in keys)) if keys else None

    def cleared(self) -> KvEvent:
        self._keys.clear()
        return KvEvent(CLEARED)


class WorkerFeed:
    """One worker's cache changes applied to an index as they happen (the simulator's
    engines report through this: `inferx.sim.kv.KvListener`)."""

    def __init__(self, index: PrefixIndex, worker_id: str) -> None:
        self.index, self.worker_id = index, worker_id
        index.cleared(worker_id)  # known from now on, holding nothing yet

    def stored(self, key: str, tokens: int) -> None:
        self.index.apply(self.worker_id, KvEvent(STORED, ((key, tokens),)))

    def removed(self, key: str) -> None:
        self.index.apply(self.worker_id, KvEvent(REMOVED, ((key, 0),)))


@dataclass(frozen=True)
class _Context:
    """One finished hop's context: its text's length, digest and last characters (a
    cheap first test), and the block keys its worker reported for it."""

    chars: int
    digest: bytes
    tail: str
    blocks: tuple[Block, ...]


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


_TAIL_CHARS = 64


def _sharing(blocks: tuple[Block, ...], kept: Sequence[_Context]) -> tuple[Block, ...]:
    """`blocks`, its leading blocks the same objects as those of the longest kept
    context it extends: a chain's contexts nest (each hop extends one before it), so
    keeping several costs a pointer per shared block, not a copy of each."""
    for context in sorted(kept, key=lambda c: len(c.blocks), reverse=True):
        shared = context.blocks
        if blocks[: len(shared)] != shared:
            shared = shared[:-1]  # its last block partial then, full now: keyed anew
            if not shared or blocks[: len(shared)] != shared:
                continue
        return shared + blocks[len(shared) :]
    return blocks


class ChainContexts:
    """The block keys of each chain's latest contexts (prompt + output of its finished
    hops, as their workers reported them), per pool: the live scheduler's description
    of a chain's next prompt by what it starts with. A context describes a prompt only
    when its text is the prompt's beginning -- the next call of an agent loop extends
    the previous one, but a parallel branch of a DAG extends the hop it branched from,
    not its sibling, and a templated hop may start anew -- so each is kept with its
    text's digest and the longest that begins the prompt answers. The latest
    `per_chain` contexts are kept per chain; least recently used chains are forgotten
    past `max_chains`."""

    def __init__(self, max_chains: int = 100_000, per_chain: int = 8) -> None:
        self.max_chains = max_chains
        self.per_chain = per_chain
        self._chains: OrderedDict[tuple[str, str], tuple[_Context, ...]] = OrderedDict()

    def get(self, pool: str, chain_key: str, prompt: str) -> tuple[Block, ...]:
        """The blocks of the chain's longest context that `prompt` starts with; () when
        none does (or the chain is unknown)."""
        contexts = self._chains.get((pool, chain_key))
        if contexts is None:
            return ()
        self._chains.move_to_end((pool, chain_key))
        for context in sorted(contexts, key=lambda c: c.chars, reverse=True):
            n = context.chars
            if n <= len(prompt) and prompt[max(n - _TAIL_CHARS, 0) : n] == context.tail:
                if _digest(prompt[:n]) == context.digest:
                    return context.blocks
        return ()

    def put(self, pool: str, chain_key: str, text: str, blocks: Sequence[Block]) -> None:
        """`text`: the hop's prompt and output, as the next prompts would start with them."""
        if not blocks or not text:
            return
        digest = _digest(text)
        kept = tuple(c for c in self._chains.get((pool, chain_key), ()) if c.digest != digest)
        context = _Context(len(text), digest, text[-_TAIL_CHARS:], _sharing(tuple(blocks), kept))
        self._chains[(pool, chain_key)] = (context, *kept)[: self.per_chain]
        self._chains.move_to_end((pool, chain_key))
        while len(self._chains) > self.max_chains:
            self._chains.popitem(last=False)

    def __len__(self) -> int:
        return len(self._chains)
