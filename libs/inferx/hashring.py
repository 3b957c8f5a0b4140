"""Consistent hashing of cache keys onto cache replicas (pure).

Each replica owns many points on a ring (virtual nodes) so keys spread evenly; adding
a replica moves only the keys that now fall to it (about 1/N of them), so a scaled-out
cache keeps most of its hits.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Iterator


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, members: Iterable[str] = (), *, vnodes: int = 160) -> None:
        self._vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self.members: frozenset[str] = frozenset()
        self.set_members(members)

    def set_members(self, members: Iterable[str]) -> None:
        members = frozenset(members)
        if members == self.members:
            return
        pairs = sorted((_point(f"{m}#{i}"), m) for m in members for i in range(self._vnodes))
        self._points = [p for p, _ in pairs]
        self._owners = [m for _, m in pairs]
        self.members = members

    def owner(self, key: str) -> str | None:
        if not self._points:
            return None
        index = bisect.bisect(self._points, _point(key)) % len(self._points)
        return self._owners[index]

    def walk(self, key: str) -> Iterator[str]:
        """Every member once, in ring order from the key's point: the owner first, then
        the members a bounded-load scheme falls back to when the owner is full."""
        if not self._points:
            return
        start = bisect.bisect(self._points, _point(key))
        seen: set[str] = set()
        for offset in range(len(self._points)):
            member = self._owners[(start + offset) % len(self._points)]
            if member not in seen:
                seen.add(member)
                yield member
                if len(seen) == len(self.members):
                    return
