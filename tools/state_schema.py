"""``python -m tools.state_schema``: rewrite ddpmon/state/state-schema.json, the JSON Schema
generated from the state file's records (``ddpmon/state/schema.py``); with ``--markdown``,
print docs/state.md's field tables. ``tests/unit/test_state.py`` fails while either is stale."""

from __future__ import annotations

import json
import sys
from typing import Any

from ddpmon.state import schema


def markdown() -> str:
    """The field tables of docs/state.md, one per record, from the records."""
    spec_of = schema.generated_schema()
    defs = {"RankState": spec_of, **spec_of["$defs"]}
    out = []
    for name, spec in defs.items():
        out.append(f"### {name}\n\n{spec.get('description', '')}\n")
        out.append("| key | type | meaning |\n|---|---|---|")
        for key, prop in spec["properties"].items():
            required = " (required)" if key in spec.get("required", ()) else ""
            out.append(
                f"| `{key}` | {_type_name(prop)}{required} | {prop.get('description', '')} |"
            )
        out.append("")
    return "\n".join(out)


def _type_name(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        return " or ".join(_type_name(p) for p in prop["anyOf"])
    if "$ref" in prop:
        return str(prop["$ref"]).rsplit("/", 1)[-1]
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_type_name(prop['items'])}"
    if kind == "object" and "additionalProperties" in prop:
        return f"map of {_type_name(prop['additionalProperties'])}"
    return str(kind)


def main() -> int:
    """Rewrite state-schema.json (and print docs/state.md's tables with --markdown)."""
    if sys.argv[1:] == ["--markdown"]:
        print(markdown())
        return 0
    with open(schema.SCHEMA_FILE, "w") as f:
        json.dump(schema.generated_schema(), f, indent=2)
        f.write("\n")
    print(schema.SCHEMA_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
