"""Model names -> worker pools -> live workers, from the etcd mirrors (pure code).

A chain names models (`qwen-7b`); a deployment maps each model to a pool of workers
in `/inferx/v1/models/<model>` (`{"pool": "tiny-llama"}`), so a laptop can serve
`qwen-7b` and `qwen-72b` with one small model. A model with no mapping is its own pool.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from google.protobuf import json_format

from inferx import etcd
from inferx.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass
class PoolDirectory:
    """Live view of models and workers; fed by PrefixMirror callbacks."""

    model_to_pool: dict[str, str] = field(default_factory=dict)
    workers_by_pool: dict[str, dict[str, common_pb2.WorkerInfo]] = field(default_factory=dict)

    def pool_of(self, model: str) -> str:
        return self.model_to_pool.get(model, model)

    def workers_for(self, model: str) -> dict[str, common_pb2.WorkerInfo]:
        return self.workers_by_pool.get(self.pool_of(model), {})

    def all_workers(self) -> list[common_pb2.WorkerInfo]:
        return [w for pool in self.workers_by_pool.values() for w in pool.values()]

    def update_models(self, items: dict[str, bytes]) -> None:
        mapping: dict[str, str] = {}
        for key, value in items.items():
            model = key.removeprefix(etcd.MODELS)
            try:
                mapping[model] = str(json.loads(value)["pool"])
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring malformed model mapping at %s: %r", key, value[:200])
        self.model_to_pool = mapping

    def update_workers(self, items: dict[str, bytes]) -> None:
        by_pool: dict[str, dict[str, common_pb2.WorkerInfo]] = {}
        for key, value in items.items():
            try:
                info = json_format.Parse(value, common_pb2.WorkerInfo(), ignore_unknown_fields=True)
            except json_format.ParseError:
                log.warning("ignoring malformed worker registration at %s", key)
                continue
            by_pool.setdefault(info.pool, {})[info.worker_id] = info
        self.workers_by_pool = by_pool


def no_worker_message(model: str, pool: str) -> str:
    if model == pool:
        return f"no live worker serves model '{model}'; start one with `inferx-worker --model {model}`"
    return (
        f"no live worker serves model '{model}' (pool '{pool}'); "
        f"start one with `inferx-worker --model {pool}`"
    )
