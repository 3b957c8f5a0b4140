"""A/B tests of chain configs in etcd, next to the versions (inferx.ab has the logic):

  /inferx/v1/chains/<tenant>/<name>/ab                     -> the running test (AbTest JSON)
  /inferx/v1/chains/<tenant>/<name>/ab-history/<start ms>  -> how each test ended

Every router reads the running test from its chain mirror, so all of them split alike
and a restart keeps the test. Stopping one (by hand, or by the guard rail) makes the
kept arm's version active, labels it `ab-winner` and writes the test's end to the
history, all audited.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import aetcd

from inferx import ab
from inferx.ab import AbTest, ArmFigures, RunOutcome
from inferx.errors import FailedPrecondition, InvalidArgument
from inferx.v1 import router_pb2
from inferx_router import metrics
from inferx_router.chain_store import ChainStore, _key
from inferx_router.records import RunRecord

log = logging.getLogger("inferx.router.ab")
audit_log = logging.getLogger("inferx.audit")

WINNER_LABEL = "ab-winner"
GUARD_EVERY_S = 0.5


class AbTests:
    def __init__(self, store: ChainStore, client: aetcd.Client) -> None:
        self._store = store
        self._client = client
        self._checking: set[tuple[str, str]] = set()  # guard stops in flight
        self._checked_at: dict[tuple[str, str], float] = {}  # monotonic time of each chain's last check

    def current(self, tenant: str, name: str) -> AbTest | None:
        """The chain's running test, from the mirror (None: none, or unreadable)."""
        raw = self._store.mirror.items.get(_key(tenant, name, "ab"))
        if raw is None:
            return None
        try:
            return ab.parse_test(raw)
        except (ValueError, KeyError, TypeError, InvalidArgument) as exc:
            log.error("ignoring the malformed A/B test of chain '%s': %s", name, exc)
            return None

    def pick(self, tenant: str, name: str, key: str) -> tuple[int, str]:
        """(version, arm) for a run keyed by `key` (session id, else run id); (0, "")
        when the chain has no test running."""
        test = self.current(tenant, name)
        if test is None:
            return 0, ""
        arm = ab.choose_arm(key, test.split_pct, salt=str(test.started_unix_ms))
        return test.version(arm), arm

    async def start(
        self, tenant: str, name: str, a: int, b: int, split_pct: float, margin: float, min_runs: int, who: str
    ) -> AbTest:
        ab.check_test(a, b, split_pct, margin=margin, min_runs=min_runs)
        for version in (a, b):
            await self._store.resolve(tenant, name, version)  # NOT_FOUND naming it
        test = AbTest(a, b, float(split_pct), int(time.time() * 1000), who, float(margin), int(min_runs))
        key = _key(tenant, name, "ab").encode()
        tx = self._client.transactions
        ok, _ = await ChainStore._etcd(
            self._client.transaction(
                compare=[tx.version(key) == 0], success=[tx.put(key, test.to_json().encode())], failure=[]
            )
        )
        if not ok:
            running = await self._read_test(tenant, name)
            what = f" (v{running.a} vs v{running.b})" if running else ""
            raise FailedPrecondition(
                f"an A/B test of chain '{name}' is running{what}; stop it first (inferx chain ab stop)"
            )
        return test

    async def stop(
        self, tenant: str, name: str, keep: str, who: str, reason: str = ""
    ) -> tuple[AbTest, int, int]:
        """End the running test keeping arm `keep`: (the test, its version now active,
        the version active before)."""
        if keep not in ab.ARMS:
            raise InvalidArgument(f"keep: must be a or b, got {keep!r}")
        key = _key(tenant, name, "ab").encode()
        got = await ChainStore._etcd(self._client.get(key))
        if got is None:
            raise FailedPrecondition(f"no A/B test of chain '{name}' is running")
        test = ab.parse_test(got.value)
        version = test.version(keep)
        before = await self._store.active_version(tenant, name)
        result = {
            "test": json.loads(test.to_json()),
            "kept": keep,
            "version": version,
            "previous_active": before,
            "stopped_by": who,
            "reason": reason or "stopped by hand",
            "stopped_unix_ms": int(time.time() * 1000),
        }
        tx = self._client.transactions
        history = _key(tenant, name, "ab-history", str(test.started_unix_ms)).encode()
        ok, _ = await ChainStore._etcd(
            self._client.transaction(
                compare=[tx.mod(key) == got.mod_revision],
                success=[tx.delete(key), tx.put(history, json.dumps(result).encode())],
                failure=[],
            )
        )
        if not ok:
            raise FailedPrecondition(f"the A/B test of chain '{name}' changed or ended meanwhile; look again")
        if before != version:
            await self._store.rollback(tenant, name, version)  # the active pointer, compare-and-swap
        await self._store.label(tenant, name, WINNER_LABEL, version)
        audit_log.info(
            "principal=%s action=chain.ab.stop target=%s kept=%s version=%d previous=%d reason=%s",
            who,
            name,
            keep,
            version,
            before,
            result["reason"].replace(" ", "_"),
        )
        return test, version, before

    async def last_result(self, tenant: str, name: str) -> tuple[AbTest | None, str]:
        prefix = _key(tenant, name, "ab-history", "").encode()
        listing = await ChainStore._etcd(self._client.get_prefix(prefix))
        ends = sorted((json.loads(kv.value) for kv in listing), key=lambda r: r["test"]["started_unix_ms"])
        if not ends:
            return None, ""
        last = ends[-1]
        test = ab.parse_test(last["test"])
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(last["stopped_unix_ms"] / 1000))
        text = (
            f"v{test.a} vs v{test.b}: kept {last['kept']} (v{last['version']}) at {when} UTC by "
            f"{last['stopped_by']}: {last['reason']}"
        )
        return test, text

    async def _read_test(self, tenant: str, name: str) -> AbTest | None:
        got = await ChainStore._etcd(self._client.get(_key(tenant, name, "ab").encode()))
        return ab.parse_test(got.value) if got is not None else None

    # ----- the guard rail -------------------------------------------------------------

    def check_guard(self, tenant: str, name: str, kept: Callable[[], Sequence[RunRecord]]) -> None:
        """After an A/B run: stop the test when an arm has fallen a margin below the
        other (on this router's kept runs), once at a time per chain and at most every
        GUARD_EVERY_S (the figures go over every kept run of the chain)."""
        test = self.current(tenant, name)
        if test is None or (tenant, name) in self._checking:
            return
        now = time.monotonic()
        if now - self._checked_at.get((tenant, name), -GUARD_EVERY_S) < GUARD_EVERY_S:
            return
        self._checked_at[(tenant, name)] = now
        a, b = figures(test, kept())
        verdict = ab.guard(a, b, margin=test.margin, min_runs=test.min_runs)
        if verdict is None:
            return
        self._checking.add((tenant, name))
        task = asyncio.create_task(self._stop_by_guard(tenant, name, verdict), name=f"ab-guard:{name}")
        task.add_done_callback(lambda _: self._checking.discard((tenant, name)))

    async def _stop_by_guard(self, tenant: str, name: str, verdict: ab.GuardVerdict) -> None:
        reason = f"guard stopped arm {verdict.stop}: {verdict.reason}"
        try:
            await self.stop(tenant, name, verdict.keep, "guard", reason)
        except Exception as exc:  # another router stopped it first, or etcd is down
            log.warning("A/B guard of chain '%s' could not stop arm %s: %s", name, verdict.stop, exc)
            return
        metrics.AB_GUARD_STOPS.labels(name, verdict.stop).inc()
        log.warning("A/B test of chain '%s': %s", name, reason)


def outcome(record: RunRecord) -> RunOutcome:
    finished = record.finished
    return RunOutcome(
        latency_ms=finished.latency_ms,
        slo_met=finished.slo_met,
        ok=finished.status == "ok",
        tokens=sum(h.usage.prompt_tokens + h.usage.completion_tokens for h in finished.hops),
        cost=finished.cost,
    )


def figures(test: AbTest, kept: Iterable[RunRecord]) -> tuple[ArmFigures, ArmFigures]:
    """Each arm's figures over the test's runs among `kept` (those that started after it)."""
    runs: dict[str, list[RunOutcome]] = {"a": [], "b": []}
    for record in kept:
        arm = record.finished.ab_arm
        if arm in runs and record.started_unix_ms >= test.started_unix_ms - 1000:
            runs[arm].append(outcome(record))
    return ab.arm_figures("a", test.a, runs["a"]), ab.arm_figures("b", test.b, runs["b"])


def arms_by_version(kept: Iterable[RunRecord]) -> list[ArmFigures]:
    """`inferx stats`: the kept runs of A/B tests per (arm, version)."""
    groups: dict[tuple[str, int], list[RunOutcome]] = {}
    for record in kept:
        if record.finished.ab_arm:
            groups.setdefault((record.finished.ab_arm, record.finished.chain_version), []).append(
                outcome(record)
            )
    return [ab.arm_figures(arm, version, runs) for (arm, version), runs in sorted(groups.items())]


def arm_message(f: ArmFigures) -> router_pb2.ArmStats:
    return router_pb2.ArmStats(
        arm=f.arm,
        version=f.version,
        runs=f.runs,
        slo_met=f.slo_met,
        errors=f.errors,
        p50_ms=f.p50_ms,
        p99_ms=f.p99_ms,
        tokens=f.tokens,
        cost=f.cost,
    )


def ab_test_message(name: str, test: AbTest) -> router_pb2.AbTest:
    return router_pb2.AbTest(
        chain=name,
        a=test.a,
        b=test.b,
        split_pct=test.split_pct,
        started_unix_ms=test.started_unix_ms,
        started_by=test.started_by,
        margin=test.margin,
        min_runs=test.min_runs,
    )
