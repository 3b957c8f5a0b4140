"""`--plot FILE`: SLO attainment and P99 chain latency against arrival rate, one curve
per policy, each policy's capacity at SLO marked. The points are the rates the capacity
search replayed (every probe is a full replay), so the curves are densest where it
matters: around each policy's capacity. Needs matplotlib (installed by `make setup`)."""

from __future__ import annotations

import math
from pathlib import Path

from inferx.errors import InvalidArgument
from inferx.sim.capacity import OVERALL_TARGET, REALTIME_TARGET, Capacity


def plot_capacity(results: dict[str, Capacity], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgument("--plot needs matplotlib: `make setup`, or pip install matplotlib") from None
    figure, (attained, latency) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    for index, (name, result) in enumerate(sorted(results.items(), key=lambda item: -item[1].rate_per_s)):
        color = f"C{index % 10}"
        probes = sorted(result.probes, key=lambda p: p.rate_per_s)
        rates = [p.rate_per_s for p in probes]
        attained.plot(
            rates, [p.attainment.overall * 100 for p in probes], "o-", color=color, label=f"{name} (all)"
        )
        realtime = [
            (p.rate_per_s, p.attainment.realtime) for p in probes if p.attainment.realtime is not None
        ]
        if realtime:
            attained.plot(
                [r for r, _ in realtime],
                [a * 100 for _, a in realtime],
                "x--",
                color=color,
                alpha=0.7,
                label=f"{name} (realtime)",
            )
        finite = [(p.rate_per_s, p.attainment.p99_latency_s) for p in probes]
        finite = [(r, v) for r, v in finite if v is not None and math.isfinite(v)]
        if finite:
            latency.plot([r for r, _ in finite], [v for _, v in finite], "o-", color=color, label=name)
        if result.rate_per_s > 0:
            for axis in (attained, latency):
                axis.axvline(result.rate_per_s, color=color, linestyle=":", linewidth=1)
    attained.axhline(REALTIME_TARGET * 100, color="grey", linewidth=0.8)
    attained.axhline(OVERALL_TARGET * 100, color="grey", linewidth=0.8, linestyle="--")
    attained.set(
        xlabel="arrival rate (chains/s)", ylabel="chains within SLO (%)", xscale="log", ylim=(0, 101)
    )
    attained.set_title("SLO attainment (dotted: capacity at SLO)")
    attained.legend(fontsize=7, ncol=2)
    latency.set(xlabel="arrival rate (chains/s)", ylabel="P99 chain latency (s)", xscale="log", yscale="log")
    latency.set_title("P99 chain latency (unfinished chains: off the chart)")
    latency.legend(fontsize=7)
    figure.suptitle(title, fontsize=9)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise InvalidArgument(f"--plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)
