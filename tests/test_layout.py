"""The layout's rules, read from the imports with `ast`, so that they hold in future changes.

The top level is the teaching surface (the stage files); plumbing/ and speed/ sit below the stages, tools/ and
bench/ above them, and tests/ above everything.

    python -m pytest tests/test_layout.py
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = {"train", "rollout", "advantage", "loss", "rewards", "eval", "grad_alloc", "tasks", "config"}
BELOW = ("plumbing", "speed")  # what the stages use; they import no stage file
ABOVE = ("tools", "bench")  # experiments, tools and benchmarks: no stage imports them at module level


def python_files():
    """Every .py file of the repo, as (module name, path): top-level `train`, `plumbing.models`, `bench.vs_trl`."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and d not in ("runs", "docs")]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT)[:-3].replace(os.sep, "."), path


MODULES = dict(python_files())
# bench/ and tests/ put their own folder on sys.path: `from vs_trl import ...`, `from dist_train import ...`
SIBLINGS = {name.split(".", 1)[1]: name for name in MODULES if name.startswith(("bench.", "tests."))}


def imported_names(path):
    """(dotted name, at module level?) for each name an absolute import in the file can bring in, at any depth
    (inside functions and methods too): `from tools import figures` gives "tools" and "tools.figures"."""
    tree = ast.parse(open(path).read(), path)
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        yield from ((name, id(node) in top) for name in names)


def imports(path):
    """(imported module, at module level?) for each import in the file that names a module of this repo."""
    out = []
    for name, top in imported_names(path):
        target = name if name in MODULES else SIBLINGS.get(name)
        if target is not None:
            out.append((target, top))
    return out


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def test_the_parser_sees_the_imports_it_is_meant_to_see():
    """A check that could not fail proves nothing: the graph has the edges we know are there."""
    assert ("loss", True) in GRAPH["train"] and ("plumbing.models", True) in GRAPH["rollout"]
    assert ("tools.judge", False) in GRAPH["eval"]  # a lazy import, inside a function
    assert ("tools.memory_plan", False) in GRAPH["train"]


def test_no_import_circles():
    """Lazy imports count too: a circle through a function-level import is still a circle."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for target, _ in GRAPH[node]:
            if target == node:
                continue
            if state.get(target) == "open":
                cycle = path[path.index(target) :] + [target]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def reaching_up(modules: dict) -> list:
    """(module, imported name) for each import, at any level, from tools/ or bench/ in a module of plumbing/ or
    speed/ (`modules`: {module name: path})."""
    return sorted(
        {
            (name, imported)
            for name, path in modules.items()
            if name.startswith(BELOW)
            for imported, _ in imported_names(path)
            if imported.split(".")[0] in ABOVE
        }
    )


def test_the_layer_check_sees_imports_from_above_at_any_level(tmp_path):
    """A check that could not fail proves nothing: a plumbing module importing tools/ lazily, in a method, and
    bench/ by its bare package name, is caught; the same imports from a tool are not the check's business."""
    source = tmp_path / "log.py"
    source.write_text(
        "import os\n\n\nclass Log:\n    def finish(self):\n        from tools.figures import "
        "plot_training_curves\n\n        import bench\n        return os, bench, plot_training_curves\n"
    )
    assert reaching_up({"plumbing.log": str(source), "tools.log": str(source)}) == [
        ("plumbing.log", "bench"),
        ("plumbing.log", "tools.figures"),
        ("plumbing.log", "tools.figures.plot_training_curves"),
    ]


def test_plumbing_and_speed_import_nothing_from_tools_or_bench():
    """The layers: plumbing/ and speed/ sit below the stages, tools/ and bench/ above them (lazy imports count)."""
    bad = reaching_up(MODULES)
    assert not bad, bad


def test_plumbing_and_speed_import_no_stage_file():
    bad = [
        (name, target)
        for name, edges in GRAPH.items()
        if name.startswith(BELOW)
        for target, _ in edges
        if target in STAGES
    ]
    assert not bad, bad


def test_no_stage_file_imports_an_experiment_or_a_bench_at_module_level():
    bad = [(name, target) for name in STAGES for target, top in GRAPH[name] if top and target.startswith(ABOVE)]
    assert not bad, bad


def test_nothing_outside_tests_imports_from_tests():
    bad = [
        (name, target)
        for name, edges in GRAPH.items()
        if not name.startswith("tests.")
        for target, _ in edges
        if target.startswith("tests.")
    ]
    assert not bad, bad


def test_the_top_level_holds_at_most_ten_python_files():
    top = sorted(name for name in MODULES if "." not in name)
    assert len(top) <= 10, top
    assert STAGES <= set(top), STAGES - set(top)


def test_every_speed_file_names_the_plain_version_and_its_test():
    """Each speed/ file opens by naming the plain version it replaces and the test that keeps the two equal."""
    for name, path in MODULES.items():
        if name.startswith("speed.") and not name.endswith("__init__"):
            doc = ast.get_docstring(ast.parse(open(path).read())) or ""
            assert "plain version" in doc and "tests/test_" in doc, name
