"""Reading what a run leaves behind: metrics.jsonl and events.jsonl, one JSON object a line."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON-lines file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
