"""The whole's budget: the training path (every .py file outside tools/, bench/, tests/ and scripts/) stays small
enough to read, plumbing/ stays below the stages, and the step loop shows the algorithm.

    python -m pytest tests/test_budget.py
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = ("tools", "bench", "tests", "scripts", "results", "docs", "runs")


def training_path() -> dict[str, str]:
    """{relative path: text} of every .py file the training path holds: the stage files, plumbing/, speed/ and any
    new folder (a folder is counted unless it is one of OUTSIDE)."""
    files = {}
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and (folder != ROOT or d not in OUTSIDE)]
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                files[os.path.relpath(path, ROOT)] = open(path, encoding="utf-8").read()
    return files


def test_the_training_path_fits_in_4500_lines_and_250000_characters():
    files = training_path()
    assert "train.py" in files and "plumbing/checkpoint.py" in files  # the walk sees what it must
    lines, chars = sum(text.count("\n") for text in files.values()), sum(map(len, files.values()))
    assert lines <= 4500 and chars <= 250_000, (lines, chars)


def test_plumbing_holds_at_most_1500_lines():
    lines = sum(text.count("\n") for path, text in training_path().items() if path.startswith("plumbing/"))
    assert lines <= 1500, lines


def test_the_step_loop_is_at_most_30_lines():
    tree = ast.parse(open(os.path.join(ROOT, "train.py")).read())
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.For) and getattr(node.target, "id", "") == "step"]
    assert len(loops) == 1, "train.py has one `for step` loop"
    body = loops[0].body
    assert body[-1].end_lineno - body[0].lineno + 1 <= 30, body[-1].end_lineno - body[0].lineno + 1
