"""docs/configuration.md, generated from the settings classes (one source of truth):
per service, every setting's config-file key, flag, environment variable, type, default
and description.

    python -m inferx.settings_doc            # (re)write docs/configuration.md (`make docs`)
    python -m inferx.settings_doc --check    # exit 1 when it is stale

tests/unit/test_configuration_doc.py fails when the file is not what this writes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from inferx.settings import CONFIG_ENV, ServiceSettings, TransportSettings

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
COMMAND = "make docs"

# The services' settings classes, by module name: libs/ does not import services/.
SERVICES = (
    ("inferx-router", "inferx_router.__main__", "RouterSettings"),
    ("inferx-scheduler", "inferx_scheduler.config", "SchedulerSettings"),
    ("inferx-memory-pool", "inferx_memory_pool.__main__", "MemoryPoolSettings"),
    ("inferx-cache", "inferx_cache.__main__", "CacheSettings"),
    ("inferx-worker", "inferx_worker.config", "WorkerSettings"),
)

INTRO = f"""# Configuration reference

<!-- Generated from the settings classes by `python -m inferx.settings_doc` ({COMMAND});
do not edit: tests/unit/test_configuration_doc.py fails when this file is stale. -->

Every service (`inferx-router`, `inferx-scheduler`, `inferx-memory-pool`, `inferx-cache`,
`inferx-worker`) and every Python tool server (`inferx.toolserver`) takes the settings
below, each from any of these places; the first one that sets it wins:

1. a flag: `--max-bytes 1048576`
2. an environment variable: `INFERX_MAX_BYTES=1048576` (the name in any case)
3. the config file: `max_bytes: 1048576`, in the YAML file `--config FILE` names (or, without
   `--config`, `${CONFIG_ENV}`)
4. the default (the tables below)

(Code that builds a settings class with keyword arguments puts them between flags and
the environment; no service does.)

## The config file

A YAML mapping of settings, checked by the same rules as the flags:

```yaml
# inferx-cache --config cache.yaml
etcd: etcd.internal:2379
port: 50054
max_bytes: 268435456   # or max-bytes: the flag's spelling, without its dashes
default_ttl_s: 600
insecure: false        # booleans are YAML's: true / false
```

- **Keys**: a setting's name as in the tables (`max_bytes`) or its flag's spelling
  without the dashes (`max-bytes`), not both for one setting. **Values**: YAML's types
  (`true`/`false`, numbers, strings; `null` leaves an optional setting unset), validated
  as the flags' are.
- Paths in the file (`tls_ca`, `knowledge_base`, `engine_profile`...) are taken from the
  process's working directory, not from the file's.
- Refused, one line naming the file and the key, exit status 2, the service not started:
  a key the service does not take (`unknown key 'max_byte' (did you mean 'max_bytes'?)`),
  one setting given twice, `config` in the file, a value its setting refuses
  (`config file cache.yaml: port: Input should be less than or equal to 65535`); and so is
  a file that is missing, unreadable, not YAML, or not a mapping. An empty file sets nothing.
- `${CONFIG_ENV}` reaches every process that inherits it (`inferx up` starts every service
  with its environment, and the services take different keys): give each its `--config`.
- `inferx-router --embedded-scheduler --scheduler-flags "--config scheduler.yaml"` reads a
  scheduler's file for the embedded scheduler (`${CONFIG_ENV}` is the router's file only).
- Examples, one per service, each checked by tests/unit/test_config_file.py:
  [deploy/config/](../deploy/config/).

Boolean flags come in pairs: `--insecure` / `--no-insecure`. A table's *Type* gives the
range its setting accepts.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferx.settings_doc", description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", type=Path, default=DOC, help=f"where to write it (default: {DOC})")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the file is stale")
    args = parser.parse_args(argv)
    text = render()
    current = args.path.read_text(encoding="utf-8") if args.path.exists() else None
    if args.check:
        if current != text:
            print(f"{args.path} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if current != text:
        args.path.write_text(text, encoding="utf-8")
        print(f"wrote {args.path}")
    return 0


def service_classes() -> list[tuple[str, type[ServiceSettings]]]:
    found = []
    for prog, module, name in SERVICES:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, ServiceSettings), f"{module}.{name} is not a ServiceSettings"
        found.append((prog, cls))
    return found


def render() -> str:
    """The whole of docs/configuration.md."""
    from inferx.toolserver import ToolServerSettings

    transport = TransportSettings.model_fields
    service = ServiceSettings.model_fields
    parts = [
        INTRO,
        "## Every service and tool server\n\n"
        "How a process reaches etcd and its peers, and where its settings come from.\n",
        _table(transport.items()),
        "## Every service\n\nEvery service also takes these.\n",
        _table((n, f) for n, f in service.items() if n not in transport),
    ]
    for prog, cls in service_classes():
        own = _own_fields(cls, service)
        doc = f"`{cls.__module__}.{cls.__name__}`"
        if own:
            parts.append(
                f"## {prog}\n\nThe settings of every service above, and these ({doc}); one of every "
                "service's settings is listed here where this service gives it another default or "
                "meaning:\n"
            )
            parts.append(_table(own))
        else:
            parts.append(f"## {prog}\n\nThe settings of every service above ({doc}).\n")
    parts.append(
        "## Tool servers\n\nA tool server run by `inferx.toolserver.run_tool_server` takes the "
        "settings of every service and tool server above, and these "
        "(`inferx.toolserver.ToolServerSettings`):\n"
    )
    parts.append(_table(_own_fields(ToolServerSettings, transport)))
    return "\n".join(parts)


def _own_fields(cls: type[TransportSettings], base: dict[str, FieldInfo]) -> list[tuple[str, FieldInfo]]:
    """`cls`'s settings that `base` lacks, or has with another type, default or description."""
    return [
        (name, field)
        for name, field in cls.model_fields.items()
        if name not in base or _signature(field) != _signature(base[name])
    ]


def _signature(field: FieldInfo) -> tuple[str, str, str]:
    return _type(field), _default(field), field.description or ""


def _table(fields: Iterable[tuple[str, FieldInfo]]) -> str:
    rows = [
        "| Key | Flag | Environment variable | Type | Default | Description |",
        "|---|---|---|---|---|---|",
    ]
    for name, field in fields:
        flag = "--" + name.replace("_", "-")
        flags = f"`{flag}`, `--no-{flag[2:]}`" if field.annotation is bool else f"`{flag}`"
        rows.append(
            "| "
            + " | ".join(
                [
                    f"`{name}`",
                    flags,
                    f"`INFERX_{name.upper()}`",
                    _cell(_type(field)),
                    _cell(_default(field)),
                    _cell(field.description or ""),
                ]
            )
            + " |"
        )
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    """Text safe in a Markdown table cell: no column breaks, no HTML tags."""
    return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text.replace("|", "\\|").replace("\n", " "))


def _type(field: FieldInfo) -> str:
    described = _annotation(field.annotation)
    bounds = []
    for item in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, attr, None) if isinstance(item, annotated_types.BaseMetadata) else None
            if value is not None:
                bounds.append(f"{sign} {value}")
    return ", ".join([described, *bounds])


def _annotation(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        named = [_annotation(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        return "required" if field.default_factory is None else "(computed)"
    return f"`{json.dumps(field.default)}`"


if __name__ == "__main__":
    raise SystemExit(main())
