"""What a replay may tell a policy about the rest of a chain: learned, never read ahead.

A live router knows a chain's declared structure (how many model calls are left) but
not how long the calls and the tools between them will take; it learns that from the
hops that already finished (`inferx.chain.plan.LearnedLatency`). Replays of a trace do
the same here: per (chain kind, call index), an exponentially weighted mean of the
observed call time (ready to finished, queueing included, as the router measures a
node) and of the observed gap after it (tool or think time). Future output lengths and
tool delays in the trace are never looked at.

A chain that is a DAG (parallel branches joined by a later call) declares which calls
each call waits for; the remaining path of a call is then the longest path, in learned
call and gap times, from it through the calls that depend on it (transitively).
"""

from __future__ import annotations

from collections.abc import Sequence

from inferx.stats import RunningMean

Key = tuple[str, int]


class RemainingPath:
    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._calls: dict[Key, RunningMean] = {}
        self._gaps: dict[Key, RunningMean] = {}
        self._kind_call: dict[str, RunningMean] = {}  # any index: the fallback for an unseen one
        self._kind_gap: dict[str, RunningMean] = {}

    def call_finished(self, kind: str, index: int, seconds: float) -> None:
        self._calls.setdefault((kind, index), RunningMean(self.alpha)).add(seconds)
        self._kind_call.setdefault(kind, RunningMean(self.alpha)).add(seconds)

    def gap_observed(self, kind: str, index: int, seconds: float) -> None:
        """The time between call `index` finishing and the next call being issued (in a
        DAG: the first of the calls that wait for it)."""
        self._gaps.setdefault((kind, index), RunningMean(self.alpha)).add(seconds)
        self._kind_gap.setdefault(kind, RunningMean(self.alpha)).add(seconds)

    def remaining_s(
        self, kind: str, index: int, calls: int, deps: Sequence[Sequence[int]] | None = None
    ) -> float:
        """Expected time from call `index` being issued to the chain's end (`calls` in
        all); 0.0 when nothing of this kind has finished yet (unknown).

        `deps[k]`: the calls call k waits for (the chain's declared structure); None: a
        sequence, each call waiting for the previous one. The result is the longest
        path from call `index` through the calls that wait on it, directly or not."""
        if kind not in self._kind_call:
            return 0.0
        if deps is None:
            total = 0.0
            for j in range(index, calls):
                total += self._get(self._calls, self._kind_call, kind, j)
                if j < calls - 1:
                    total += self._get(self._gaps, self._kind_gap, kind, j)
            return total
        # Longest path in a DAG whose edges point to higher indices: one forward pass.
        end = {index: self._get(self._calls, self._kind_call, kind, index)}  # finish, from index's issue
        for k in range(index + 1, calls):
            starts = [end[j] + self._get(self._gaps, self._kind_gap, kind, j) for j in deps[k] if j in end]
            if starts:
                end[k] = max(starts) + self._get(self._calls, self._kind_call, kind, k)
        return max(end.values())

    @staticmethod
    def _get(table: dict[Key, RunningMean], fallback: dict[str, RunningMean], kind: str, index: int) -> float:
        mean = table.get((kind, index)) or fallback.get(kind)
        return mean.value if mean is not None else 0.0
