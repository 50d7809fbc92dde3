"""The repository's files one training step runs code from: every function called, at any depth, from inside
train.py's `for step` loop, on the tiny model (two steps of arith), with and without a save and a
held-out evaluation in the step.

    python bench/step_files.py
"""

import ast
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]


def step_files(**overrides) -> list[str]:
    import tools.figures
    import train
    from tools.tiny_model import build_tiny_model

    tools.figures.plot_training_curves = lambda paths, out, **kwargs: out  # after the loop anyway
    loop = next(
        node
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, "train.py")).read()))
        if isinstance(node, ast.For) and getattr(node.target, "id", "") == "step"
    )
    train_py, files = os.path.join(ROOT, "train.py"), set()

    def on_call(frame, event, arg):
        if event != "call":
            return
        caller = frame
        while caller is not None and not (caller.f_code.co_filename == train_py and caller.f_code.co_name == "train"):
            caller = caller.f_back
        path = os.path.abspath(frame.f_code.co_filename)
        if (
            caller
            and loop.lineno <= caller.f_lineno <= loop.end_lineno
            and path.startswith(ROOT + os.sep)
            and os.path.isfile(path)
            and not path.startswith(os.path.join(ROOT, "tests"))
        ):
            files.add(os.path.relpath(path, ROOT))

    work = tempfile.mkdtemp(prefix="step-files-")
    args = train.Args(
        **{
            **dict(
                task="arith",
                model=build_tiny_model(os.path.join(work, "model")),
                M=4,
                steps=2,
                rollout_batch=4,
                micro_batch=8,
                max_tokens=4,
                warmup_steps=0,
                eval_examples=0,
                dtype="float32",
                out_dir=os.path.join(work, "run"),
            ),
            **overrides,
        }
    )
    sys.setprofile(on_call)
    try:
        train.main(args)
    finally:
        sys.setprofile(None)
    return sorted(files)


if __name__ == "__main__":
    for what, overrides in (
        ("a plain step", {}),
        ("a step that saves and evaluates", dict(save_every=1, eval_examples=4, eval_every=1)),
    ):
        files = step_files(**overrides)
        print(f"{what}: {len(files)} files: {' '.join(files)}")
