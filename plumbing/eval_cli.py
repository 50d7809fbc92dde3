"""What eval.py's command line needs besides the evaluation: its flags, the sampler it loads (and the room the model's
context leaves a prompt), the step of a train.py checkpoint (which sets the sampled streams), the summary it prints
and the result file it writes whole. Its flags are checked as train.py's (plumbing/checks.py: eval_flag_error).

    python -m pytest tests/test_eval.py -q
"""

import importlib.util
import os
import sys

import torch

from plumbing.checks import no_room_error
from plumbing.cli import first_line
from plumbing.data import DataError
from plumbing.files import write_json
from plumbing.models import ModelLoadError, hub_context, load_tokenizer, model_context, resolve_model
from plumbing.prompts import encode_prompts, valid_prompt


def add_eval_args(parser, reward_choices):
    """eval.py's flags, but the judge's (tools/judge.py: add_judge_args); `reward_choices`: exact and
    rewards.REWARD_TERMS."""
    parser.add_argument("--model", required=True, help="HF folder, hub id, checkpoint folder or alias")
    parser.add_argument("--task", required=True, help="task name (see tasks.py)")
    parser.add_argument("--split", default="test", choices=["train", "test"])
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N examples")
    parser.add_argument("--samples", type=int, default=0, help="K samples per prompt for pass@k (0: greedy only)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for pass@k")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for pass@k and mean@K")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--reward", default="exact", choices=reward_choices, help="verifier, or a term")
    parser.add_argument("--reward-weights", default="", help="reward terms as train.py takes them: exact=1,format=0.1")
    parser.add_argument("--sampler", default=None, choices=["hf", "vllm"], help="default: vllm on a GPU, else hf")
    parser.add_argument("--data-file", default=None, help="local data file for the task (passed to task.load)")
    parser.add_argument("--demo-file", default=None, help="countdown --reward sim: a local copy of "
                        "HuggingFaceTB/Countdown-Task-GOLD's demonstrations (same columns), joined to the puzzles")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default: <model dir or .>/eval_<task>_<split>.json)")


def load_sampler(args, examples, make_sampler):
    """The sampler eval.py scores with: --sampler's backend (default: vLLM on a GPU where installed, else HF), made by
    `make_sampler` (rollout.py's) with a context that holds the longest prompt of `examples` beside --max-tokens.
    A model that cannot be used is a ModelLoadError, a prompt too long a DataError: one line each."""
    backend = args.sampler or ("vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf")
    try:
        path = resolve_model(args.model)
        # as train.py: a prompt the context cannot hold beside --max-tokens is refused, naming its row, not scored;
        # vLLM needs the context length up front: long-context tasks (meetingbank) exceed its default
        room = prompt_room(path, args.max_tokens)
        prompts = encode_prompts(load_tokenizer(path), [e for e in examples if valid_prompt(e.prompt)], max_len=room)
        return make_sampler(backend, path, dtype="bfloat16" if backend == "hf" else "auto", seed=args.seed,
                            max_model_len=max(map(len, prompts), default=0) + args.max_tokens)
    except (OSError, ValueError) as err:  # a ModelLoadError is one line already, naming --model and HF_HUB_OFFLINE
        raise err if isinstance(err, (ModelLoadError, DataError)) else ModelLoadError(
            f"cannot use model {args.model!r}: {first_line(err, limit=None)}") from None


def prompt_room(path: str, max_tokens: int) -> int:
    """The tokens a prompt may have in the model's context beside --max-tokens (unbounded where the context is
    unknown); DataError, one line, where there is no room."""
    context = model_context(path) or hub_context(path)
    if error := no_room_error(max_tokens, context):
        raise DataError(error)
    return (context or sys.maxsize) - max_tokens


def checkpoint_step(model: str) -> int:
    """The training step of a train.py checkpoint folder (its samples are drawn as train.py drew them then), else 0."""
    from plumbing.checkpoint import CheckpointError, safe_load

    if not os.path.isfile(os.path.join(model, "trainer_state.pt")):
        return 0
    try:  # the step alone: a checkpoint from before DCP shards (no trainer/) still scores
        state = safe_load(model, "trainer_state.pt")
        return int(state.get("step", 0)) if isinstance(state, dict) else 0
    except CheckpointError as err:  # one line, exit 2, as any model that cannot be used
        raise ModelLoadError(str(err)) from None


def format_summary(summary: dict) -> str:
    rows = {("pass@1 (greedy)" if k == "pass@1" else k): v for k, v in summary.items() if k != "pass@k"}
    rows.update({f"pass@{k} (sampled)": v for k, v in summary.get("pass@k", {}).items()})
    shown = {k: f"{100 * v:.1f}%" if k.startswith(("pass@", "trunc_frac"))  # fractions as percentages
             else f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in rows.items()}
    return "\n".join(f"{k:<24}{v}" for k, v in shown.items())


def write_result(out: str, result: dict) -> None:
    """--out written whole; an OSError, one line, saying the summary printed above is the result."""
    try:
        write_json(out, result, indent=1)
    except OSError as err:
        kept = f"; the earlier {out} is intact" if os.path.exists(out) else ""
        raise OSError(f"cannot write {out} ({err.strerror or first_line(err, limit=200)}): the summary above "
                      f"is the result{kept}") from None
