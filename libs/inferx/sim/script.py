"""SIMULATED replies for the sim worker (`inferx-worker --engine sim --sim-script FILE`).

The sim engine runs no model: its text is synthetic, so no tool call would ever come out
of it. A script makes it answer scripted text instead, for tests and demos of agent
loops (a tool call in the chat template's format, then a final answer):

    # the first rule whose `when` occurs in the rendered prompt gives the reply
    - when: "parcel TRK-42: out for delivery"
      reply: "Order 7 is out for delivery."
    - when: "Where is order 7?"
      reply: |-
        <tool_call>
        {"name": "lookup_order", "arguments": {"order_id": "7"}}
        </tool_call>

A rule without `when` matches every prompt. An agent loop's prompt grows with each call
and still holds what earlier steps matched, so list later steps first. A prompt no rule
matches gets the sim's synthetic text. The latency model is the sim's own: the reply
costs as many decode steps as it has tokens (capped by max_tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from inferx.errors import InvalidArgument


class ScriptRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    when: str = Field("", description="text the rendered prompt must contain ('' or absent: any prompt)")
    reply: str = Field(min_length=1, description="the reply text (may hold a tool call)")


_RULES = TypeAdapter(list[ScriptRule])


@dataclass(frozen=True)
class SimScript:
    rules: tuple[ScriptRule, ...]
    origin: str = ""

    @classmethod
    def from_data(cls, data: object, origin: str = "") -> SimScript:
        """InvalidArgument naming the bad rule when `data` is not a list of rules."""
        where = f"{origin}: " if origin else ""
        try:
            rules = _RULES.validate_python(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            place = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
            raise InvalidArgument(
                f"{where}sim script{place}: {first['msg']} "
                "(expected a list of {when: TEXT, reply: TEXT} rules)"
            ) from None
        return cls(tuple(rules), origin)

    @classmethod
    def load(cls, path: str | Path) -> SimScript:
        """A YAML or JSON file of rules."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidArgument(f"{path}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise InvalidArgument(f"{path}: not valid YAML/JSON ({exc})") from None
        return cls.from_data(data, str(path))

    def reply(self, prompt: str) -> str | None:
        """The reply of the first rule matching `prompt`; None when none does."""
        return next((rule.reply for rule in self.rules if rule.when in prompt), None)
