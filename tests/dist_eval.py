"""tests/test_eval_sampled.py's torchrun job: train.main on a toy task, scoring the held-out prompts greedily and
with 3 samples each, on the task's own set and a benchmark fixture, in one process or under torchrun:

    python tests/dist_eval.py OUT_DIR MODEL_DIR
    torchrun --nproc_per_node 2 tests/dist_eval.py OUT_DIR MODEL_DIR
"""

import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from test_eval_sampled import SayTask  # noqa: E402

import tasks  # noqa: E402
import train  # noqa: E402

if __name__ == "__main__":
    out_dir, model_dir = sys.argv[1:3]
    tasks.TASKS["say"] = SayTask()
    aime = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "aime24.jsonl")
    train.main(
        train.Args(
            task="say",
            model=model_dir,
            M=4,
            rollout_batch=4,
            micro_batch=4,
            steps=1,
            max_tokens=4,
            lr=1e-2,
            eval_examples=5,
            eval_samples=3,
            eval_tasks=f"aime24={aime}",
            dtype="float32",
            out_dir=out_dir,
            sampler="hf",
        )
    )
