"""Agent-chain configs: the format, its validation and prompt templates (pure code, no I/O).

Typical use::

    from inferx.chain import load_chain_text
    chain = load_chain_text(yaml_text, source="chain.yaml")   # raises ChainConfigError
    for warning in chain.warnings: ...
    order = topological_order(chain.config)
"""

from inferx.chain.durations import (
    ValueFormatError,
    format_duration_ms,
    parse_availability,
    parse_duration_ms,
)
from inferx.chain.schema import (
    NODE_TYPES,
    PRIORITIES,
    TIERS,
    ChainConfig,
    InputSpec,
    NodeSpec,
    SloSpec,
)
from inferx.chain.template import (
    MissingReferenceError,
    Reference,
    TemplateSyntaxError,
    check_template,
    references,
    render,
)
from inferx.chain.validate import (
    ChainConfigError,
    ValidatedChain,
    critical_path,
    load_chain_text,
    required_inputs,
    sinks,
    topological_order,
    upstream,
    validate_chain,
)

__all__ = [
    "NODE_TYPES",
    "PRIORITIES",
    "TIERS",
    "ChainConfig",
    "ChainConfigError",
    "InputSpec",
    "MissingReferenceError",
    "NodeSpec",
    "Reference",
    "SloSpec",
    "TemplateSyntaxError",
    "ValidatedChain",
    "ValueFormatError",
    "check_template",
    "critical_path",
    "format_duration_ms",
    "load_chain_text",
    "parse_availability",
    "parse_duration_ms",
    "references",
    "render",
    "required_inputs",
    "sinks",
    "topological_order",
    "upstream",
    "validate_chain",
]
