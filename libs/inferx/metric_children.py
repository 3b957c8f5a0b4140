"""Prometheus label children, looked up once per label set.

`metric.labels(...)` validates and joins the labels and takes the metric's lock on every
call (a few microseconds); on the hop path several of them ran per hop in every service
(issue #14). `child(metric, ...)` keeps the child: only for metrics whose label sets are
never `.remove()`d (a removed child would be kept here, detached from its metric)."""

from __future__ import annotations

from typing import Any

_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, the same object from the second call on."""
    key = (id(metric), labels)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*labels)
    return found
