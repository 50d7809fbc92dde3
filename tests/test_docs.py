"""The prose's pointers into the code resolve: every `file.py: name` and `tests/test_x.py::test_name` that README.md
and docs/*.md cite names a file that exists and a name defined in it; and the README stays a front door.

    python -m pytest tests/test_docs.py -q
"""

import ast
import fnmatch
import functools
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

PATH = r"[A-Za-z0-9_][\w./-]*\.py"
NAME = r"[A-Za-z_][\w.]*(?:\*\w*)*"  # a dotted name; `*` only in test names
ARGS = r"(?:\([^)]*\)|\[[^\]]*\])?"  # `(demos=True)` or `["truncated"]` after a name
# `file.py: a, b.c, d(x=1), E["key"]` (a list only in code spans); `tests/test_x.py::test_name` (maybe with `*`)
CITATION = re.compile(rf"(?<![\w/.-])({PATH})(::|: )({NAME})({ARGS})((?:, {NAME}{ARGS})*)")
LISTED = re.compile(rf"({NAME})({ARGS})")
BARE_PATH = re.compile(r"(?<![\w/.:-])((?:[\w-]+/)+[\w.-]+\.(?:py|sh|sbatch|md|png))\b(?!::|: )")
MODULE = re.compile(r"python -m (tools|bench)\.([a-z_]\w*)")
IMPORT = re.compile(r"\bfrom ([\w.]+) import (\w+(?:, \w+)*)")
DOTTED = re.compile(r"([a-z_]\w*)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?")  # a whole span: `rewards.score`
LINK = re.compile(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)")  # a relative link's target


def _texts(page: str):
    """(line number, text, whole) for each piece of a page that may cite code: inline code spans, which may run over
    a line break (`whole`: a comma list of names is read whole), and, first name only, the prose outside them and
    fenced blocks (their comments apart from their code)."""
    lines, fenced, chunk = page.split("\n") + [""], False, []
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            yield number, line.split("#", 1)[0], False
            if "#" in line:
                yield number, line.split("#", 1)[1], False
        elif line.strip():
            chunk.append(line)
            continue
        start = number - len(chunk)  # a paragraph ends: spans never cross one
        text = "\n".join(chunk)
        for m in re.finditer(r"`([^`]+)`", text):
            yield start + text[: m.start()].count("\n"), re.sub(r"::\s+", "::", " ".join(m.group(1).split())), True
        prose = re.sub(r"`[^`]+`", lambda m: " " + "\n" * m.group().count("\n"), text)
        yield from ((start + i, piece, False) for i, piece in enumerate(prose.split("\n")))
        chunk = []


def citations(page: str, folder: str = "") -> list[tuple[int, str, str, str]]:
    """[(line, path, name, key)] for each `path: name` a page's text cites; name "" for a bare path or a link (its
    target relative to `folder`, the page's)."""
    found = []
    for number, text, whole in _texts(page):
        for m in CITATION.finditer(text):
            path, sep, first, first_args, rest = m.groups()
            if sep == ": " and text[m.end(4) : m.end(4) + 1] == ":":  # an error message: `train.py: error: ...`
                continue
            names = [(first, first_args)] + (LISTED.findall(rest) if whole and sep == ": " else [])
            for name, args in names:
                key = re.fullmatch(r'\["([^"]+)"\]', args)
                found.append((number, path, name.rstrip("."), key.group(1) if key else ""))
        found += [(number, path, "", "") for path in BARE_PATH.findall(text)]
        found += [(number, f"{folder}/{module}.py", "", "") for folder, module in MODULE.findall(text)]
        for module, names in IMPORT.findall(text):
            path = module.replace(".", "/") + ".py"
            if os.path.exists(os.path.join(ROOT, path.split("/")[0] if "." in module else path)):  # ours
                found += [(number, path, name, "") for name in names.split(", ")]
        dotted = DOTTED.fullmatch(text) if whole else None  # `module.name`, module a stage file (not `eval.json`)
        if dotted and os.path.exists(os.path.join(ROOT, dotted.group(1) + ".py")):
            if dotted.group(2) not in ("py", "json", "jsonl", "md", "png"):
                found.append((number, dotted.group(1) + ".py", dotted.group(2), ""))
        if not whole:
            found += [(number, os.path.normpath(os.path.join(folder, target)), "", "") for target in LINK.findall(text)]
    return list(dict.fromkeys(found))


def defined_names(body: list) -> dict:
    """{name: node} for what a module or class body defines: defs, classes, assignments (through if/try/with)."""
    names = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody", "handlers"):
                for inner in getattr(node, part, []):
                    names.update(defined_names(inner.body if isinstance(inner, ast.ExceptHandler) else [inner]))
    return names


@functools.cache
def _module(path: str) -> tuple[str, dict]:
    source = open(path).read()
    return source, defined_names(ast.parse(source, path).body)


def broken(page: str, number: int, path: str, name: str, key: str) -> str | None:
    """Why this citation does not resolve, or None."""
    where = os.path.join(ROOT, path)
    if not name:
        local = "/" not in path or os.path.isdir(os.path.join(ROOT, path.split("/")[0]))
        return f"{page}:{number}: {path} does not exist" if local and not os.path.exists(where) else None
    if not os.path.exists(where):
        return f"{page}:{number}: {path} does not exist (cited for {name})"
    source, scope = _module(where)
    if "*" in name:
        if not fnmatch.filter(scope, name):
            return f"{page}:{number}: nothing in {path} matches {name}"
        return None
    for part in name.split("."):
        if part not in scope:
            return f"{page}:{number}: {path} defines no {name}"
        node = scope[part]
        scope = defined_names(node.body) if isinstance(node, ast.ClassDef) else {}
    if key and f'"{key}"' not in source:
        return f'{page}:{number}: {path} has no key "{key}" in {name}'
    return None


def files_map_entries() -> list[tuple[int, str, str]]:
    """[(line, path, name)] from the README's Files map: a `dir/` line lists files in dir; on a `file.py` line, a
    parenthesis that holds only names, `(Args)` or `(make_sampler, HFSampler)`, holds names defined in file.py."""
    lines = open(os.path.join(ROOT, "README.md")).read().split("\n")
    start = lines.index("```", lines.index("## Files")) + 1
    entries, folder, file = [], "", ""
    for number, line in enumerate(lines[start : lines.index("```", start)], start + 1):
        head = line.split()[0] if line.strip() and not line.startswith(" ") else ""
        if head:
            folder, file = (head, "") if head.endswith("/") else ("", head if head.endswith(".py") else "")
            entries += [(number, file, "")] if file else []
        text = line[len(head) :] if head else line
        if folder:
            entries += [(number, folder + p, "") for p in re.findall(r"\b([\w/]+\.(?:py|sh|sbatch))\b", text)]
        elif file:
            for group in re.findall(r"\(([A-Za-z_]\w*(?:, [A-Za-z_]\w*)*)\)", text):
                entries += [(number, file, name) for name in group.split(", ")]
    return entries


def test_the_files_map_names_every_file_of_the_training_path():
    """Each top-level .py file has its line in the README's Files map; each file of plumbing/ and speed/ is named."""
    listed = {path for _, path, _ in files_map_entries()}
    files = {
        os.path.relpath(p, ROOT)
        for pattern in ("*.py", "plumbing/*.py", "speed/*.py")
        for p in glob.glob(os.path.join(ROOT, pattern))
        if not p.endswith("__init__.py")
    }
    assert not files - listed, f"not in the Files map: {sorted(files - listed)}"


def test_every_cited_file_and_name_exists():
    problems = []
    for page in PAGES:
        for number, path, name, key in citations(open(os.path.join(ROOT, page)).read(), os.path.dirname(page)):
            problem = broken(page, number, path, name, key)
            if problem:
                problems.append(problem)
    for number, path, name in files_map_entries():
        problem = broken("README.md (Files)", number, path, name, "")
        if problem:
            problems.append(problem)
    assert not problems, "broken references:\n" + "\n".join(sorted(set(problems)))


def test_the_reader_finds_citations_of_each_form():
    """The parser reads the forms the pages use (a parser that finds nothing would pass the test above)."""
    text = (
        '`loss.py: policy_loss, kl_k3` `tasks.py: Task.load(demos=True)` `loss.py: ROW_FILTERS["truncated"]`\n'
        "(config.py: PRESETS, sized) `tests/test_docs.py::\n  test_every_*` `train.py: error: the run stops`\n"
        "\n```python\nfrom tools.figures import plot_figure1, kl_estimator_of  # rollout.py: score -> tasks.py\n"
        "```\n[x](fork.md#recipes) `python -m tools.sweep` [y](https://example.com/a.md) `rewards.math_reward`\n"
        "`eval.json` `data.max_prompt_length`\n"
    )
    got = sorted((path, name, key) for _, path, name, key in citations(text, "docs"))
    assert got == sorted(
        [
            ("loss.py", "policy_loss", ""),
            ("loss.py", "kl_k3", ""),
            ("tasks.py", "Task.load", ""),
            ("loss.py", "ROW_FILTERS", "truncated"),
            ("config.py", "PRESETS", ""),
            ("tests/test_docs.py", "test_every_*", ""),
            ("tools/figures.py", "plot_figure1", ""),
            ("tools/figures.py", "kl_estimator_of", ""),
            ("rollout.py", "score", ""),
            ("docs/fork.md", "", ""),
            ("tools/sweep.py", "", ""),
            ("rewards.py", "math_reward", ""),
        ]
    )
    assert broken("x.md", 1, "loss.py", "no_such_name", "") == "x.md:1: loss.py defines no no_such_name"
    assert broken("x.md", 1, "tasks.py", "Task.no_such_method", "")
    assert broken("x.md", 1, "loss.py", "ROW_FILTERS", "no-such-key")
    assert broken("x.md", 1, "plumbing/no_such_file.py", "", "")
    assert broken("x.md", 1, "trl/trainer/grpo_config.py", "", "") is None  # upstream, not ours


def test_the_readme_is_a_front_door():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) <= 200 and len(text.split()) <= 2000, (len(text.splitlines()), len(text.split()))
