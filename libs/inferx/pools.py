"""Model names -> worker pools -> live workers, from the etcd mirrors (pure code).

A chain names models (`qwen-7b`); a deployment maps each model to a pool of workers
in `/inferx/v1/models/<model>` (`{"pool": "tiny-llama"}`), so a laptop can serve
`qwen-7b` and `qwen-72b` with one small model. A model with no mapping is its own pool.

A mapping may also say how the model writes tool calls (`{"pool": ..., "tool_call_format":
"mistral"}`, one of inferx.openai_compat.toolcalls.FORMATS); without it, the format the
pool's workers register (their --tool-call-format, or what their chat template says),
else the default (hermes). Likewise how a reasoning model's replies carry its thinking
(`"reasoning_parser": "deepseek_r1"`, one of inferx.openai_compat.reasoning's
REASONING_PARSERS, "none" for none); without it, what the pool's workers register (their
--reasoning-parser), else none.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from inferx import etcd
from inferx.errors import FailedPrecondition
from inferx.openai_compat.reasoning import REASONING_PARSERS, check_reasoning_parser
from inferx.openai_compat.toolcalls import DEFAULT_FORMAT, FORMATS, check_format
from inferx.v1 import common_pb2


def model_entry(spec: Any) -> dict[str, str]:
    """A model mapping's value, checked: {"pool": NAME} with an optional known
    "tool_call_format" and "reasoning_parser" ("none": the model does not reason).
    ValueError naming what is wrong."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("pool"), str) or not spec["pool"]:
        raise ValueError("expected {pool: NAME} (and optionally tool_call_format, reasoning_parser)")
    entry = {"pool": str(spec["pool"])}
    if spec.get("tool_call_format") is not None:
        entry["tool_call_format"] = check_format(spec["tool_call_format"])
    if spec.get("reasoning_parser") is not None:
        mapped_reasoning_parser(spec["reasoning_parser"])  # checked; stored as written ("none" too)
        entry["reasoning_parser"] = spec["reasoning_parser"]
    return entry


def mapped_reasoning_parser(value: Any) -> str:
    """A mapping's reasoning_parser, checked ("none" is ""); ValueError otherwise."""
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or 'none', not {value!r}"
        )
    return "" if value == "none" else check_reasoning_parser(value)


log = logging.getLogger(__name__)


@dataclass
class PoolDirectory:
    """Live view of models and workers; fed by PrefixMirror callbacks."""

    model_to_pool: dict[str, str] = field(default_factory=dict)
    # a mapping's tool-call format, and the mappings whose format is not one InferX knows
    model_tool_formats: dict[str, str] = field(default_factory=dict)
    model_reasoning_parsers: dict[str, str] = field(default_factory=dict)  # "" = the model does not reason
    model_reasoning_problems: dict[str, str] = field(default_factory=dict)
    model_problems: dict[str, str] = field(default_factory=dict)
    workers_by_pool: dict[str, dict[str, common_pb2.WorkerInfo]] = field(default_factory=dict)

    def pool_of(self, model: str) -> str:
        return self.model_to_pool.get(model, model)

    def workers_for(self, model: str) -> dict[str, common_pb2.WorkerInfo]:
        return self.workers_by_pool.get(self.pool_of(model), {})

    def all_workers(self) -> list[common_pb2.WorkerInfo]:
        return [w for pool in self.workers_by_pool.values() for w in pool.values()]

    def tool_call_format(self, model: str) -> str:
        """How `model` writes tool calls: its mapping's format, else the one its pool's
        workers register (the most of them, should they differ), else the default.
        FailedPrecondition when the mapping or a worker names a format InferX does not
        know, or when an `openai`-engine worker writes calls in another format than the
        one chosen (never a silent default, never calls misread as text)."""
        if model in self.model_problems:
            raise FailedPrecondition(self.model_problems[model])
        workers = self.workers_for(model).values()
        chosen = (
            self.model_tool_formats.get(model)
            or _registered(model, workers, "tool_call_format", FORMATS)
            or DEFAULT_FORMAT
        )
        for worker in workers:
            # A mapping may override what a template was read as; but an `openai` engine
            # writes the calls its server read out back in the format it registers, by
            # choice: read in another, every call would reach the caller as text.
            if worker.engine == "openai" and worker.tool_call_format not in ("", chosen):
                raise FailedPrecondition(
                    f"worker {worker.worker_id} of model '{model}' (openai engine) writes tool calls in "
                    f"{worker.tool_call_format!r} but this router reads the model's in {chosen!r}; start it "
                    f"with --tool-call-format {chosen}, or set the model mapping's tool_call_format"
                )
        return chosen

    def reasoning_parser(self, model: str) -> str:
        """How `model`'s replies carry its thinking: its mapping's parser, else the one its
        pool's workers register (the most of them, should they differ), else "" (none).
        FailedPrecondition when the mapping or a worker names one InferX does not know."""
        if model in self.model_reasoning_problems:
            raise FailedPrecondition(self.model_reasoning_problems[model])
        if model in self.model_reasoning_parsers:
            return self.model_reasoning_parsers[model]
        return (
            _registered(model, self.workers_for(model).values(), "reasoning_parser", REASONING_PARSERS) or ""
        )

    def update_models(self, items: dict[str, bytes]) -> None:
        mapping: dict[str, str] = {}
        formats: dict[str, str] = {}
        reasoning: dict[str, str] = {}
        reasoning_problems: dict[str, str] = {}
        problems: dict[str, str] = {}
        for key, value in items.items():
            model = key.removeprefix(etcd.MODELS)
            try:
                raw = json.loads(value)
                mapping[model] = str(raw["pool"])
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring malformed model mapping at %s: %r", key, value[:200])
                continue
            if raw.get("reasoning_parser") is not None:
                try:
                    reasoning[model] = mapped_reasoning_parser(raw["reasoning_parser"])
                except ValueError as exc:
                    # Its chat calls are refused, naming this; chains and text completions run.
                    reasoning_problems[model] = f"the model mapping at {key}: {exc}"
                    log.error("%s", reasoning_problems[model])
            try:
                entry = model_entry({**raw, "reasoning_parser": None})  # checked above
            except ValueError as exc:
                # The model still serves calls; those that offer tools are refused, naming this.
                problems[model] = f"the model mapping at {key}: {exc}"
                log.error("%s", problems[model])
                continue
            if "tool_call_format" in entry:
                formats[model] = entry["tool_call_format"]
        self.model_to_pool = mapping
        self.model_tool_formats = formats
        self.model_reasoning_parsers = reasoning
        self.model_reasoning_problems = reasoning_problems
        self.model_problems = problems

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


def _registered(
    model: str, workers: Iterable[common_pb2.WorkerInfo], field_name: str, known: tuple[str, ...]
) -> str | None:
    """What the most of `model`'s workers register in `field_name` (tool_call_format,
    reasoning_parser; ties by name), None when none does. FailedPrecondition naming one
    this router does not know (a newer worker's), never a silent default."""
    values = [value for w in workers if (value := getattr(w, field_name))]
    if not values:  # the common case, on every call's path: no Counter to build
        return None
    named = Counter(values)
    for name in named:
        if name not in known:
            what = field_name.replace("_", " ").replace("tool call", "tool-call")
            raise FailedPrecondition(
                f"a worker of model '{model}' registers {what} {name!r}, which this router does not "
                f"know ({', '.join(known)}); set the model mapping's {field_name}"
            )
    return min(named, key=lambda name: (-named[name], name))


def no_worker_message(model: str, pool: str) -> str:
    if model == pool:
        return f"no live worker serves model '{model}'; start one with `inferx-worker --model {model}`"
    return (
        f"no live worker serves model '{model}' (pool '{pool}'); "
        f"start one with `inferx-worker --model {pool}`"
    )
