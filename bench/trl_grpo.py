"""The baseline of bench/vs_trl.py: Hugging Face TRL's GRPOTrainer on the same work as our train.py, timed.

Runs in its own virtual environment (`.venv-trl`, made by bench/vs_trl.py: trl==1.16.0 over this
environment's torch and transformers). The prompts come from a JSONL that bench/vs_trl.py writes in
the main environment from tasks.py and train.py's own prompt order, one row per prompt in step order
(`shuffle_dataset=False` keeps that order); the reward is tasks.py's, imported from the repository, so
both sides score completions with the same code. The last line printed is `RESULT {json}`.

    .venv-trl/bin/python bench/trl_grpo.py --model MODEL_DIR --prompts-file prompts.jsonl --steps 3

Per optimizer step (one generation batch of prompts x M completions, one optimizer step, as ours):
step_s from TrainerCallback.on_step_begin to on_step_end; gen_s = time inside the model's `generate`;
reward_s = time inside the reward function; train_s = step_s - gen_s - reward_s (tokenising, the
reference forward, the loss forward/backward over the micro-batches, the optimizer step); tokens =
non-pad prompt + completion tokens of the generation batch.
"""

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF model folder (plumbing.models.resolve_model's output)")
    parser.add_argument("--prompts-file", required=True, help="JSONL: prompt, prompt_ids, gold, reference, meta, uid")
    parser.add_argument("--task", default="arith")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--M", type=int, default=8, help="completions per prompt (num_generations)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--beta", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    t_start = time.perf_counter()

    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, REPO)
    from tasks import Example, get_task  # the same scoring code as train.py

    batch = opts.prompts * opts.M
    if batch % opts.micro_batch:
        raise SystemExit(f"trl_grpo.py: prompts x M ({batch}) must divide by --micro-batch ({opts.micro_batch})")
    need = opts.steps * opts.prompts
    rows = [json.loads(line) for line in open(opts.prompts_file)][:need]
    if len(rows) < need:
        raise SystemExit(f"trl_grpo.py: {opts.prompts_file} holds {len(rows)} prompts, need {need}")
    task = get_task(opts.task)
    examples = [
        Example(prompt=r["prompt"], gold=r["gold"], reference=r["reference"], meta=r["meta"], uid=r["uid"])
        for r in rows
    ]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "row": i} for i, r in enumerate(rows)])

    timers = {"gen": 0.0, "reward": 0.0}
    steps, expected, seen = [], [r["prompt_ids"] for r in rows], []

    def arith_reward(prompts, completions, row, **kwargs):
        t = time.perf_counter()
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        out = [task.reward(text, examples[i], kind="exact") for text, i in zip(texts, row)]
        timers["reward"] += time.perf_counter() - t
        return out

    class TimedGRPOTrainer(GRPOTrainer):
        def _tokenize_prompts(self, prompts):
            prompt_ids, images, fields = super()._tokenize_prompts(prompts)
            for ids in prompt_ids:  # each prompt comes M times in a row; keep one copy
                if not seen or seen[-1] != list(ids):
                    seen.append(list(ids))
            return prompt_ids, images, fields

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            tokens = int(out["prompt_mask"].sum() + out["completion_mask"].sum())
            steps.append({"tokens": tokens, "completion_tokens": int(out["completion_mask"].sum())})
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0, timers["gen"], timers["reward"] = time.perf_counter(), 0.0, 0.0
            if len(steps) == 0:
                self.setup_s = self.t0 - t_start

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - self.t0
            steps[-1].update(
                step_s=step_s,
                gen_s=timers["gen"],
                reward_s=timers["reward"],
                train_s=step_s - timers["gen"] - timers["reward"],
            )

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        seed=opts.seed,
        data_seed=opts.seed,
        num_generations=opts.M,
        per_device_train_batch_size=opts.micro_batch,
        gradient_accumulation_steps=batch // opts.micro_batch,  # one generation batch = one optimizer step
        max_completion_length=opts.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=opts.beta,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        num_iterations=1,
        learning_rate=opts.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=opts.weight_decay,
        max_grad_norm=opts.max_grad_norm,
        optim="adamw_torch",
        bf16=opts.dtype == "bfloat16",
        use_cpu=True,
        use_vllm=False,
        max_steps=opts.steps,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    timer = StepTimer()
    trainer = TimedGRPOTrainer(
        model=opts.model, reward_funcs=arith_reward, args=config, train_dataset=dataset, callbacks=[timer]
    )
    model = trainer.model
    generate = model.generate

    def timed_generate(*args, **kwargs):
        t = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            timers["gen"] += time.perf_counter() - t

    model.generate = timed_generate  # TRL calls generate on this same object (one CPU process, no wrapper)
    trainer.train()
    total = time.perf_counter() - t_start
    shutil.rmtree(config.output_dir, ignore_errors=True)
    if len(steps) != opts.steps or any("step_s" not in s for s in steps) or not all(s["gen_s"] > 0 for s in steps):
        raise SystemExit(f"trl_grpo.py: timing hooks did not fire as expected: {steps}")
    expected_unique = [ids for i, ids in enumerate(expected) if i == 0 or ids != expected[i - 1]]
    result = {
        "side": "trl",
        "trl_version": trl.__version__,
        "torch_version": torch.__version__,
        "steps": steps,
        "setup_s": timer.setup_s,
        "total_s": total,
        "prompts_match": seen == expected_unique,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "reward_mean": [h["reward"] for h in trainer.state.log_history if "reward" in h],
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
