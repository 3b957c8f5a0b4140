"""Prompt and argument templates: ``{{ inputs.NAME }}`` and ``{{ nodes.NODE_ID.output }}``.

The language is deliberately tiny. Only those two expression forms exist, so
validation can know every value a node needs before the chain runs (which input
must be supplied, which upstream node must have finished). Anything else inside
``{{ }}`` is an error rather than literal text, because a typo like
``{{ input.question }}`` should fail at config time, not reach the model as-is.

Whitespace inside the braces is optional. A ``{{`` that is never closed is an
error; a lone ``}}`` is literal text, so JSON examples in prompts keep working.

Rendering is a single pass: substituted values are never scanned again, so a
node output that happens to contain ``{{ inputs.secret }}`` is inserted verbatim
instead of being expanded (no template injection through model output).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MissingReferenceError",
    "Reference",
    "TemplateSyntaxError",
    "check_template",
    "references",
    "render",
    "static_head",
]

INPUT_NAME_RE = r"[A-Za-z_][A-Za-z0-9_]*"
NODE_ID_RE = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"

_TAG = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_INPUT_EXPR = re.compile(rf"inputs\.({INPUT_NAME_RE})")
# Node ids may contain dots, so the id is everything between "nodes." and the
# final ".output"; the regex backtracks to find that split.
_NODE_EXPR = re.compile(rf"nodes\.({NODE_ID_RE})\.output")

_EXPECTED = "expected inputs.NAME or nodes.NODE_ID.output"


@dataclass(frozen=True)
class Reference:
    """One value a template needs: an input of the run or a node's output."""

    kind: Literal["inputs", "nodes"]
    name: str

    def __str__(self) -> str:
        return f"inputs.{self.name}" if self.kind == "inputs" else f"nodes.{self.name}.output"


class TemplateSyntaxError(ValueError):
    """A template with expressions outside the language; `.problems` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class MissingReferenceError(KeyError):
    """`render` was not given a value the template refers to."""

    def __init__(self, reference: Reference, message: str) -> None:
        super().__init__(message)
        self.reference = reference
        self.message = message

    def __str__(self) -> str:
        # KeyError's own __str__ wraps the message in quotes; keep it readable.
        return self.message


def _parse_expression(expression: str) -> Reference | None:
    match = _INPUT_EXPR.fullmatch(expression)
    if match is not None:
        return Reference("inputs", match.group(1))
    match = _NODE_EXPR.fullmatch(expression)
    if match is not None:
        return Reference("nodes", match.group(1))
    return None


def _scan(template: str) -> tuple[tuple[tuple[re.Match[str], Reference | None], ...], tuple[str, ...]]:
    """Every tag with its parsed reference (None when bad), and every problem found."""
    tags: list[tuple[re.Match[str], Reference | None]] = []
    problems: list[str] = []
    end = 0
    for match in _TAG.finditer(template):
        expression = match.group(1).strip()
        reference = _parse_expression(expression)
        if reference is None:
            if expression:
                problems.append(f"bad template expression '{{{{ {expression} }}}}': {_EXPECTED}")
            else:
                problems.append(f"empty template expression '{match.group(0)}': {_EXPECTED}")
        tags.append((match, reference))
        end = match.end()
    unclosed = template.find("{{", end)
    if unclosed != -1:
        snippet = template[unclosed : unclosed + 30]
        problems.append(f"unclosed '{{{{' at character {unclosed}: {snippet!r}")
    return tuple(tags), tuple(problems)


# A chain's templates are few and rendered on every run (each model hop's prompt): parsed
# once each. Only where they render: they come from stored configs, while validation
# (ValidateChain: any caller's configs, each up to --max-config-bytes) parses afresh, so
# it cannot fill this. Bounded, since stored configs change over time.
_scan_once = functools.lru_cache(maxsize=4096)(_scan)


def check_template(template: str) -> list[str]:
    """Every syntax problem in `template` (empty when it is valid); never raises."""
    return list(_scan(template)[1])


def references(template: str, *, skip_errors: bool = False) -> list[Reference]:
    """The distinct references in `template`, in order of first appearance.

    Raises TemplateSyntaxError naming every bad expression, unless `skip_errors`
    is set: then the bad ones are left out (validation reports them separately
    and still wants to check the good ones).
    """
    tags, problems = _scan(template)
    if problems and not skip_errors:
        raise TemplateSyntaxError(list(problems))
    seen: dict[Reference, None] = {}
    for _, reference in tags:
        if reference is not None:
            seen.setdefault(reference, None)
    return list(seen)


def render(template: str, inputs: Mapping[str, str], outputs: Mapping[str, str]) -> str:
    """`template` with every reference replaced by its value.

    `inputs` maps input names to values, `outputs` maps node ids to their
    outputs. Raises TemplateSyntaxError for bad expressions and
    MissingReferenceError (a KeyError) for the first reference with no value.
    """
    tags, problems = _scan_once(template)
    if problems:
        raise TemplateSyntaxError(list(problems))
    pieces: list[str] = []
    position = 0
    for match, reference in tags:
        assert reference is not None
        pieces.append(template[position : match.start()])
        pieces.append(_lookup(reference, inputs, outputs))
        position = match.end()
    pieces.append(template[position:])
    return "".join(pieces)


def _lookup(reference: Reference, inputs: Mapping[str, str], outputs: Mapping[str, str]) -> str:
    if reference.kind == "inputs":
        source, noun, given = inputs, "input", "inputs given"
    else:
        source, noun, given = outputs, "node output", "outputs available"
    if reference.name not in source:
        available = ", ".join(sorted(source)) or "none"
        raise MissingReferenceError(
            reference,
            f"template needs {reference} but there is no {noun} named "
            f"'{reference.name}' ({given}: {available})",
        )
    return str(source[reference.name])


def static_head(template: str) -> str:
    """The text before the template's first expression (all of it when it has none):
    what every rendering of it starts with, whatever the inputs and outputs."""
    match = _TAG.search(template)
    return template if match is None else template[: match.start()]
