"""Helpers for tests/test_rollout_step.py: a fake sampler whose rewards are written by hand, and the job it runs
under `torchrun --nproc_per_node 2` (gloo on CPU): DAPO's refill on the fake sampler, then train.py with --rollout dapo.

    torchrun --nproc_per_node 2 tests/dist_rollout.py refill OUT_DIR      # the fake sampler: rank0.pt, rank1.pt
    torchrun --nproc_per_node 2 tests/dist_rollout.py e2e OUT_DIR MODEL_DIR   # train.py --rollout dapo, 2 steps
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # the repo root

import rollout  # noqa: E402
import tasks  # noqa: E402
import train  # noqa: E402
from rollout import Completion  # noqa: E402


class FakeSampler:
    """Sample k of every prompt is the text "k": PatternTask scores it by its prompt's pattern. Records each call."""

    def __init__(self):
        self.calls = []  # (prompts, seed) per generate

    def generate(self, prompts, *, n, max_tokens, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None):
        self.calls.append((len(prompts), seed))
        return [[Completion([1, 2], [-0.5, -0.5], str(k), "stop") for k in range(n)] for _ in prompts]


class PatternTask:
    """Sample k of a prompt scores the prompt's meta["pattern"][k]: the rewards of every group, by hand."""

    name, has_verifier = "pattern", True

    def reward(self, completion, example, kind="exact", **lengths):
        return float(example.meta["pattern"][int(completion)])


def pattern_data(patterns):
    """(train_set, train_ids): prompt i has rewards patterns[i], token ids [i] and uid p{i}."""
    examples = [
        tasks.Example(prompt=[], gold="", reference="", meta={"pattern": list(p)}, uid=f"p{i}")
        for i, p in enumerate(patterns)
    ]
    return examples, [[i] for i in range(len(patterns))]


def refill(out_dir):
    """DAPO on the fake sampler, rank by rank: what each rank returns, saved for the test to compare."""
    rank, world = dist.get_rank(), dist.get_world_size()
    patterns = [[0, 0, 0, 0] if i % 3 else [0, i + 1, 0, 0] for i in range(30)]  # a third have signal, each its own
    train_set, train_ids = pattern_data(patterns)
    args = train.Args(M=4, rollout_batch=4, seed=3, rollout="dapo", max_refill_rounds=6)
    batch = rollout.ROLLOUTS["dapo"](
        4,
        sampler=FakeSampler(),
        task=PatternTask(),
        train_set=train_set,
        train_ids=train_ids,
        weights={"exact": 1.0},
        args=args,
        rank=rank,
        world=world,
        device=torch.device("cpu"),
    )
    torch.save(
        {
            "metrics": batch.metrics,
            "rewards": batch.scores["rewards"],
            "uids": [e.uid for e in batch.examples],
            "own": [e.meta["pattern"] for e in batch.examples],
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    job, out_dir, *rest = sys.argv[1:]
    if job == "refill":
        dist.init_process_group("gloo")
        refill(out_dir)
        dist.barrier()
        dist.destroy_process_group()
    else:  # train.main sets up and tears down the process group itself
        from dist_train import DigitTask

        tasks.TASKS["digits"] = DigitTask()
        train.main(
            train.Args(
                task="digits",
                model=rest[0],
                M=4,
                rollout_batch=4,
                micro_batch=4,
                steps=2,
                max_tokens=4,
                lr=1e-2,
                eval_examples=0,
                dtype="float32",
                out_dir=out_dir,
                rollout="dapo",
                max_refill_rounds=3,
            )
        )
