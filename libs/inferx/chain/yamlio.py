"""The one normalised YAML form of a chain config (used by `chain get`, `diff`, and to
tell whether a file differs from the active version). Multi-line strings such as
prompts are written as literal blocks so diffs stay readable."""

from __future__ import annotations

import yaml

from inferx.chain.schema import ChainConfig


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_config_yaml(config: ChainConfig) -> str:
    return yaml.dump(config.to_document(), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
