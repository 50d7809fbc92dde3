"""How often rewards.math_reward agrees with math-verify's own test cases (docs/rewards.md, note 1).

    python -m tools.math_verify_cases PATH/TO/Math-Verify      # a checkout of github.com/huggingface/Math-Verify

Reads every `@pytest.mark.parametrize` table of the checkout's tests/ whose rows hold a gold, a pred and an
expected verdict, scores math_reward(pred, gold) and prints the agreement, then each disagreement with its test.
A table whose rows are not literals is evaluated with only `math` in scope (one test builds its gold with an
f-string); anything else in it is skipped and named.
"""

import ast
import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import rewards  # noqa: E402


def cases(repo: pathlib.Path) -> list[dict]:
    """Each parametrized row with gold, pred and expected (or result), named by its file and test."""
    rows = []
    for path in sorted((repo / "tests").glob("test_*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            for dec in getattr(fn, "decorator_list", []):
                if not (isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize"):
                    continue
                names = ast.literal_eval(dec.args[0])
                names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)]
                if not {"gold", "pred"} <= set(names):
                    continue
                try:
                    table = ast.literal_eval(dec.args[1])
                except ValueError:
                    table = eval(compile(ast.Expression(dec.args[1]), str(path), "eval"), {"math": math})
                for row in table:
                    case = dict(zip(names, row), test=f"{path.name}::{fn.name}")
                    case["expected"] = bool(case.get("expected", case.get("result")))
                    rows.append(case)
    return rows


def main():
    if len(sys.argv) != 2 or not (pathlib.Path(sys.argv[1]) / "tests").is_dir():
        sys.exit("usage: python -m tools.math_verify_cases PATH/TO/Math-Verify (a checkout with tests/)")
    rows = cases(pathlib.Path(sys.argv[1]))
    misses = [c for c in rows if bool(rewards.math_reward(c["pred"], c["gold"])) != c["expected"]]
    print(f"math_reward agrees with math-verify's expected verdict on {len(rows) - len(misses)} of {len(rows)}")
    for c in misses:
        settings = {k: v for k, v in c.items() if k not in ("gold", "pred", "expected", "result", "test")}
        print(
            f"  {c['test']}: expected {int(c['expected'])}, gold {json.dumps(c['gold'][:80])}, "
            f"pred {json.dumps(c['pred'][:80])}{', ' + str(settings) if settings else ''}"
        )


if __name__ == "__main__":
    main()
