"""No function of the planner is longer than a reader can hold at once."""

from __future__ import annotations

import ast
from pathlib import Path

PLANNING = Path(__file__).resolve().parent.parent / "orchestrator" / "planning"
MAX_LINES = 60


def test_no_planner_function_is_over_sixty_lines():
    long = []
    for path in sorted(PLANNING.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_LINES} lines: {', '.join(long)}"
