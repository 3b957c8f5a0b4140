"""Off-peak runs against real etcd, services and sim workers: a chain with
`schedule: off_peak` outside its quiet hours waits (listed by `inferx status` with
why), then runs once its latest start comes and finishes by its deadline; a run asking
for off-peak on an idle pool goes at once; bad schedules are named."""

from __future__ import annotations

import asyncio
import time

import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack
from inferx.errors import InvalidArgument
from tests.integration.test_chain_runs import _cli

pytestmark = pytest.mark.integration

CHAIN = """
agent_chain:
  name: NAME
  slo: {end_to_end_latency_p99: 5s}
  schedule: SCHEDULE
  off_peak: {within: 12s, quiet_hours: "QUIET"}
  nodes:
    - {id: digest, type: model_inference, model: qwen-7b, timeout: 2s, max_tokens: 4, prompt: "Digest"}
"""


def config(name: str, schedule: str) -> str:
    hour = time.gmtime().tm_hour
    quiet = f"{(hour + 2) % 24}-{(hour + 3) % 24}"  # not now
    return CHAIN.replace("NAME", name).replace("SCHEDULE", schedule).replace("QUIET", quiet)


async def test_an_off_peak_chain_waits_outside_quiet_hours_then_meets_its_deadline(
    sim_stack: LocalStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # the status tables' cells on one line each
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(config("nightly_digest", "off_peak"))
        started = time.monotonic()
        run = asyncio.create_task(client.chain_result("nightly_digest"))
        waiting = []
        for _ in range(50):
            await asyncio.sleep(0.1)
            waiting = [w for w in (await client.status()).off_peak_waiting if w.chain == "nightly_digest"]
            if waiting:
                break
        assert waiting, "the hop never showed as waiting"
        assert waiting[0].node_id == "digest" and waiting[0].reason.startswith("outside quiet hours")
        assert waiting[0].latest_start_unix_ms > time.time() * 1000
        shown = await asyncio.to_thread(_cli, sim_stack, "status")  # wide enough: COLUMNS
        assert shown.returncode == 0, shown.stderr
        assert "off-peak, waiting for room" in shown.stdout and "nightly_digest" in shown.stdout
        assert "outside quiet hours" in shown.stdout
        finished = await run
        took = time.monotonic() - started
    assert finished.status == "ok", finished.error
    # latest start: 12 s - 2 x the 2 s node timeout - 1 s recheck = 7 s after the start
    assert 5.0 < took < 12.0
    assert finished.slo_ms == 12_000 and finished.slo_met


async def test_a_run_may_ask_for_off_peak_and_bad_schedules_are_named(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        plain = config("adhoc_digest", "now").replace("  off_peak:", "  # off_peak:")
        await client.put_chain(plain)  # no quiet hours: an idle pool has room at once
        started = time.monotonic()
        finished = await client.chain_result(
            "adhoc_digest", schedule="off_peak", off_peak_within_ms=3_600_000
        )
        assert finished.status == "ok", finished.error
        assert finished.slo_ms == 3_600_000 and finished.slo_met
        assert time.monotonic() - started < 5
        with pytest.raises(InvalidArgument, match="schedule: unknown value 'later'"):
            await client.chain_result("adhoc_digest", schedule="later")
        with pytest.raises(InvalidArgument, match="off_peak_within_ms: only with schedule off_peak"):
            await client.chain_result("adhoc_digest", schedule="now", off_peak_within_ms=5)
    bad = _cli(sim_stack, "run", "adhoc_digest", "--off-peak", "soon")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
