"""Writing benchmark results: every raw number as JSON, a markdown table for people."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# benchmarks/kernels.py shares its name with the `kernels` package, and a script's own folder
# comes first on the import path. `import report` (the first local import of every script)
# therefore imports the package (light by design) with the folder off the path, then puts the
# folder back at the end: later `import kernels...` find the package in sys.modules.
_HERE = Path(__file__).resolve().parent
if "kernels" not in sys.modules:
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    import kernels  # noqa: E402, F401
    sys.path.append(str(_HERE))


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
