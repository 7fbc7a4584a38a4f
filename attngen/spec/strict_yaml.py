"""A spec file is untrusted input that becomes executed code, so it is read strictly.

YAML 1.2 core scalars only (`true`/`false`, decimal ints, plain decimals, null), so YAML 1.1's
surprises stay strings: `no` is not False, `010` is not 8, `12:30` is not 750, `1e3` and
dates are not numbers; duplicate keys, non-string keys, anchors and aliases are refused. Every
failure is one line that names the line of the file (YamlError); attngen.spec turns it into a
SpecError naming the file.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class YamlError(ValueError):
    """Why a text is not strict YAML, in one line."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core scalars only, no duplicate keys, no anchors or aliases."""

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        event = self.peek_event()  # type: ignore[no-untyped-call]
        line = event.start_mark.line + 1  # the parser marks every event it makes
        if isinstance(event, yaml.AliasEvent):
            raise YamlError(f"line {line}: YAML aliases are not allowed")
        # Nodes do not keep their anchor; the event that starts them does.
        if getattr(event, "anchor", None) is not None:
            raise YamlError(f"line {line}: YAML anchors are not allowed")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        keys: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                raise YamlError(f"line {key_node.start_mark.line + 1}: key {key!r} is not a name")
            if key in keys:
                raise YamlError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            keys.add(key)
        return super().construct_mapping(node, deep=deep)


# Replace PyYAML's YAML 1.1 implicit resolvers: only these plain scalars become non-strings.
_StrictLoader.yaml_implicit_resolvers = {}
for _tag, _regexp, _first in (
    ("tag:yaml.org,2002:bool", r"^(?:true|false)$", "tf"),
    ("tag:yaml.org,2002:int", r"^-?(?:0|[1-9][0-9]*)$", "-0123456789"),
    ("tag:yaml.org,2002:float", r"^-?(?:0|[1-9][0-9]*)\.[0-9]+$", "-0123456789"),
    ("tag:yaml.org,2002:null", r"^(?:~|null|)$", ["~", "n", ""]),
):
    _StrictLoader.add_implicit_resolver(_tag, re.compile(_regexp), list(_first))


def load_yaml(text: str) -> Any:
    """Parse one YAML document strictly; every failure is a one-line YamlError."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        # One line: some PyYAML messages (ReaderError) span several. The context says what
        # was expected ("expected a single document in the stream"), the problem what was found.
        parts = [getattr(exc, "context", None), getattr(exc, "problem", None)]
        problem = " ".join((", ".join(str(p) for p in parts if p) or str(exc)).split())
        raise YamlError(f"{where}not valid YAML ({problem})") from None
