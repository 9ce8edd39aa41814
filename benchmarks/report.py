"""Writing benchmark results: every raw number as JSON, a markdown table for people."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out: str | Path, result: dict, caption: str, header: list[str], rows: list[list[str]]) -> None:
    """`<out>.json` holds `result`; `<out>.md` a captioned table (right-aligned numbers). Prints the table."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=2))
    lines = [
        caption,
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
        *["| " + " | ".join(row) + " |" for row in rows],
    ]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
