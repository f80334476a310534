"""Print the runtime config's flags as a markdown table (for docs/configuration.md):
`python -m hybridcache.services.config_docs`. The table is generated from services/config.py, so
it lists exactly the flags the commands take, with their defaults."""

from __future__ import annotations

import sys

from hybridcache.services.config import config_fields, flag_kwargs, flag_name, format_value


def flag_table() -> str:
    """One row per RuntimeConfig field: flag, default, choices, the `serve` roles it reaches, help."""
    rows = ["| flag | default | values | `serve` roles | what it sets |", "|---|---|---|---|---|"]
    for f in config_fields():
        kw = flag_kwargs(f)
        if "choices" in kw:
            values = "{" + ",".join(kw["choices"]) + "}"
        elif f.metadata.get("metavar") or isinstance(f.default, bool):
            values = kw["metavar"]
        else:
            values = kw["type"].__name__
        roles = ", ".join(f.metadata["roles"])
        text = f.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{flag_name(f)}` | `{format_value(f.default)}` | `{values}` | {roles} | {text} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    sys.stdout.write(flag_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
