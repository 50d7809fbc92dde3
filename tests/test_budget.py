"""tools/budget.py, the lint step `.ci/run` runs beside ruff: what it counts and what it refuses, on code written here.

The repository's own numbers are not asserted here: a fork's added line must not fail its tests (`.ci/run` holds
the project to its budget).

    python -m pytest tests/test_budget.py
"""

import ast
import textwrap

from tools import budget


def measure(code: str, path: str = "stage.py") -> dict:
    return budget.measure({path: textwrap.dedent(code)})[path]


def test_code_tokens_skip_comments_docstrings_and_layout():
    plain = measure("def f(x):\n    return x + 1\n")
    prose = measure('''
        """A module docstring, however long."""
        # a comment on its own line
        def f(x):
            """f's docstring."""

            return x + 1  # a trailing comment
        ''')
    # def f ( x ) : return x + 1 -> 10 tokens either way
    assert plain["tokens"] == prose["tokens"] == 10
    assert prose["comments"] == 1 and plain["comments"] == 0


def test_a_string_that_is_not_a_docstring_counts():
    assert measure("x = 1\n'not a docstring'\n")["tokens"] == measure("x = 1\n'a'\n")["tokens"] == 4


def test_statements_count_nested_ones():
    assert measure("for i in range(3):\n    if i:\n        print(i)\n")["statements"] == 3


def ideas(code: str) -> list[str]:
    (statement,) = ast.parse(textwrap.dedent(code)).body
    return budget.packed_ideas(statement)


def test_one_idea_a_statement_finds_each_packing():
    assert ideas("a, b = f() if c else None, g()") == ["conditional", "tuple assignment"]
    assert ideas("x = a if b else (c if d else e)") == ["nested conditional"]
    assert ideas("os._exit(sys.stdout.flush() or 0)") == ["call() or CONSTANT"]
    assert ideas("if (n := len([y for y in xs])):\n    pass") == ["comprehension", "walrus"]
    assert ideas("for a, b in [(x, x) for x in xs]:\n    pass") == ["comprehension", "tuple assignment"]


def test_one_idea_alone_passes():
    for code in ("a, b = f(), g()", "x = a if b else c", "ys = [y for y in xs]", "x = f() or default"):
        assert ideas(code) == [], code
    # a compound statement's header counts alone: its body's statements are their own
    assert ideas("if x if y else z:\n    a, b = f(), g()") == []


def test_problems_name_each_broken_check():
    packed = {"train.py": "for step in range(2):\n    a, b = (f() if c else None), g()\n"}
    found = budget.problems(budget.measure(packed))
    assert any("train.py:2: one idea a statement" in line for line in found), found
    assert not any("step loop" in line for line in found), found
    long_loop = "for step in range(2):\n" + "    x = 1\n" * (budget.MAX_LOOP_STATEMENTS + 1)
    found = budget.problems(budget.measure({"train.py": long_loop}))
    assert any("the step loop holds 31 statements" in line for line in found), found
    dense = {"train.py": "for step in range(2):\n    pass\n", "plumbing/a.py": f"x = {list(range(30))}\n"}
    found = budget.problems(budget.measure(dense))
    assert any("plumbing/ holds" in line for line in found), found
    assert any("tokens a statement" in line for line in found), found


def test_the_walk_sees_the_training_path_and_skips_the_rest(tmp_path):
    for path in ("train.py", "plumbing/checkpoint.py", "newfolder/extra.py", "tools/t.py", "tests/test_x.py"):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text("x = 1\n")
    assert set(budget.training_path(str(tmp_path))) == {"train.py", "plumbing/checkpoint.py", "newfolder/extra.py"}
