"""Jobs for tests/test_dcp.py, run in one process or under `torchrun --nproc_per_node 2` (FSDP2 over gloo on CPU):

    torchrun --nproc_per_node 2 tests/dist_checkpoint.py train OUT_DIR MODEL_DIR STEPS [RESUME]  # train.main, digits
    torchrun --nproc_per_node 2 tests/dist_checkpoint.py load CKPT MODEL_DIR OUT.pt   # a resume's state, gathered
    torchrun --nproc_per_node 2 tests/dist_checkpoint.py measure OUT_DIR MODEL_DIR    # save + resume: time, peak RSS
"""

import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]

from dist_train import DigitTask  # noqa: E402

import tasks  # noqa: E402
import train  # noqa: E402


def run_args(out_dir, model_dir, steps, resume=""):
    return train.Args(task="digits", model=model_dir, M=4, rollout_batch=4, micro_batch=4, steps=int(steps),
                      max_tokens=4, lr=1e-2, warmup_steps=0, eval_examples=0, dtype="float32", out_dir=out_dir,
                      save_every=1, beta=0.1, reference="ema", ref_ema=0.5, resume=resume)


def load(ckpt, model_dir, out_path):
    """What a resume restores on this world size (train.py's setup), gathered whole: model, AdamW, reference."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    args = run_args(os.path.dirname(ckpt), model_dir, 3, resume=ckpt)
    distributed, rank, world, device = train.init_distributed(args.seed)
    _, model, ref_model = train.load_models(args, ckpt, model_dir, device)
    optimizer = train.make_optimizer(model, args)
    step = train.load_checkpoint(ckpt, model, optimizer, train.make_scheduler(optimizer, args), rank, args.lr,
                                 args.weight_decay, ref_model)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=full)
    ref_state = get_model_state_dict(ref_model, options=full)
    if rank == 0:
        torch.save({"step": step, "model": model_state, "optimizer": optim_state["state"], "reference": ref_state},
                   out_path)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(out_dir, model_dir):
    """One save and one resume of a policy with its AdamW state and an EMA reference: each rank's seconds and its
    peak RSS growth over the set-up (the models loaded, the optimizer's moments created)."""
    from plumbing.checkpoint import load_checkpoint, save_checkpoint
    from plumbing.models import load_tokenizer

    args = run_args(out_dir, model_dir, 1)
    distributed, rank, world, device = train.init_distributed(args.seed)
    _, model, ref_model = train.load_models(args, None, model_dir, device)
    optimizer, tokenizer = train.make_optimizer(model, args), load_tokenizer(model_dir)
    scheduler = train.make_scheduler(optimizer, args)
    for p in model.parameters():  # one step, so that AdamW holds its moments
        p.grad = torch.ones_like(p)
    optimizer.step()
    os.makedirs(out_dir, exist_ok=True)
    base, t0 = peak_rss_mb(), time.perf_counter()
    save_checkpoint(out_dir, 1, model, optimizer, scheduler, tokenizer, args, ref_model)
    saved, t1 = peak_rss_mb(), time.perf_counter()
    load_checkpoint(os.path.join(out_dir, "checkpoint-000001"), model, optimizer, scheduler, rank, ref_model=ref_model)
    t2 = time.perf_counter()
    row = {"world": world, "rank": rank, "base_rss_mb": round(base), "save_s": round(t1 - t0, 2),
           "save_peak_growth_mb": round(saved - base), "resume_s": round(t2 - t1, 2),
           "resume_peak_growth_mb": round(peak_rss_mb() - base)}
    print("measure " + json.dumps(row), flush=True)


if __name__ == "__main__":
    job, *rest = sys.argv[1:]
    tasks.TASKS["digits"] = DigitTask()
    if job == "train":
        train.main(run_args(*rest))
    else:
        {"load": load, "measure": measure}[job](*rest)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
