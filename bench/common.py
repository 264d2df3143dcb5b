"""What every benchmark here shares: where results go and how they are written."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_result(result: dict, out: str | Path) -> None:
    """Write ``result`` as JSON to ``out`` (folders created) and say where."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    print(f"wrote {out}")
