"""Jobs for tests/test_dcp.py, run in one process or under `torchrun --nproc_per_node 2` (FSDP2 over gloo on CPU):

torchrun --nproc_per_node 2 tests/dist_checkpoint.py train OUT_DIR MODEL_DIR STEPS [RESUME]  # train.main, digits
torchrun --nproc_per_node 2 tests/dist_checkpoint.py load MODEL_DIR CKPT OUT.pt [CKPT OUT.pt]... # resumed
torchrun --nproc_per_node 2 tests/dist_checkpoint.py fail OUT_DIR MODEL_DIR   # rank 1's disk full mid-save
torchrun --nproc_per_node 2 tests/dist_checkpoint.py unshared OUT_DIR MODEL_DIR   # each rank its own folder
python tests/dist_checkpoint.py model MODEL_DIR HIDDEN LAYERS [DTYPE]  # a bigger random model, tiny tokenizer
torchrun --nproc_per_node 2 tests/dist_checkpoint.py measure-save OUT MODEL [frozen] # a save: seconds, RSS
torchrun --nproc_per_node 2 tests/dist_checkpoint.py measure-resume CKPT MODEL [frozen] # a resume: the same
torchrun --nproc_per_node 2 tests/dist_checkpoint.py measure-load MODEL   # the start: models loaded, sharded
"""

import io
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]

from dist_train import DigitTask  # noqa: E402

import tasks  # noqa: E402
import train  # noqa: E402


def run_args(out_dir, model_dir, steps, resume="", reference="ema"):
    moving = dict(reference="ema", ref_ema=0.5) if reference == "ema" else {}
    return train.Args(
        task="digits",
        model=model_dir,
        M=4,
        rollout_batch=4,
        micro_batch=4,
        steps=int(steps),
        max_tokens=4,
        lr=1e-2,
        warmup_steps=0,
        eval_examples=0,
        dtype="float32",
        out_dir=out_dir,
        save_every=1,
        beta=0.1,
        resume=resume,
        **moving,
    )


def load(model_dir, *pairs):
    """What a resume of each CKPT restores on this world size (train.py's setup), gathered whole into its OUT.pt:
    model, AdamW, reference. One launch for several checkpoints: a launch costs more than a load."""
    distributed, rank, world, device = train.init_distributed(run_args("", model_dir, 3).seed)
    for ckpt, out_path in zip(pairs[::2], pairs[1::2]):
        load_one(ckpt, model_dir, out_path, rank, device)


def load_one(ckpt, model_dir, out_path, rank, device):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    args = run_args(os.path.dirname(ckpt), model_dir, 3, resume=ckpt)
    _, model, ref_model = train.load_models(args, ckpt, model_dir, device)
    optimizer = train.make_optimizer(model, args)
    step = train.load_checkpoint(ckpt, model, optimizer, train.make_scheduler(optimizer, args), rank, args, ref_model)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=full)
    ref_state = get_model_state_dict(ref_model, options=full)
    if rank == 0:
        torch.save(
            {"step": step, "model": model_state, "optimizer": optim_state["state"], "reference": ref_state}, out_path
        )


class RssPeak:
    """This process's resident memory, sampled every 2 ms by a thread while the block runs: (at start, peak) MB."""

    def __enter__(self):
        import threading

        self.start, self.peak, self.running = rss_mb(), rss_mb(), True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        self.t0 = time.perf_counter()
        return self

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, rss_mb())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_mb())


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def report(job, world, rank, watch):
    row = {
        "job": job,
        "world": world,
        "rank": rank,
        "seconds": round(watch.seconds, 2),
        "rss_at_start_mb": round(watch.start),
        "peak_mb": round(watch.peak),
        "peak_over_start_mb": round(watch.peak - watch.start),
    }
    print("measure " + json.dumps(row), flush=True)


def measure_save(out_dir, model_dir, reference="ema"):
    """One save of a policy with its AdamW moments and an EMA reference, measured on each rank."""
    from plumbing.checkpoint import save_checkpoint
    from plumbing.models import load_tokenizer

    args = run_args(out_dir, model_dir, 1, reference=reference)
    distributed, rank, world, device = train.init_distributed(args.seed)
    _, model, ref_model = train.load_models(args, None, model_dir, device)
    ref_model = ref_model if reference == "ema" else None  # frozen: not saved
    optimizer, tokenizer = train.make_optimizer(model, args), load_tokenizer(model_dir)
    for p in model.parameters():  # one step, so that AdamW holds its moments
        p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    os.makedirs(out_dir, exist_ok=True)
    with RssPeak() as watch:
        save_checkpoint(out_dir, 1, model, optimizer, train.make_scheduler(optimizer, args), tokenizer, args, ref_model)
    report("save", world, rank, watch)


def measure_load(model_dir):
    """train.py's start, the policy and an EMA reference loaded (and sharded), measured on each rank."""
    args = run_args("", model_dir, 1)
    distributed, rank, world, device = train.init_distributed(args.seed)
    with RssPeak() as watch:
        _, model, ref_model = train.load_models(args, None, model_dir, device)
        for p in [*model.parameters(), *ref_model.parameters()]:  # a float32 file is mapped: read every page
            train.local(p).sum()
    report("load", world, rank, watch)


def measure_resume(ckpt, model_dir, reference="ema"):
    """train.py's resume of that checkpoint (models loaded from it, a fresh AdamW), measured around
    load_checkpoint on each rank."""
    args = run_args(os.path.dirname(ckpt), model_dir, 3, resume=ckpt, reference=reference)
    distributed, rank, world, device = train.init_distributed(args.seed)
    _, model, ref_model = train.load_models(args, ckpt, model_dir, device)
    ref_model = ref_model if reference == "ema" else None
    optimizer = train.make_optimizer(model, args)
    with RssPeak() as watch:
        train.load_checkpoint(ckpt, model, optimizer, train.make_scheduler(optimizer, args), rank, args, ref_model)
    report("resume", world, rank, watch)


def fail(out_dir, model_dir, unshared=False):
    """A save whose shard write fails on rank 1 alone (a full disk), or (`unshared`) whose ranks write to folders
    that are not one (node-local disks at one path): every rank prints the error it raised."""
    import errno

    from plumbing.checkpoint import CheckpointError, save_checkpoint
    from plumbing.models import load_tokenizer

    args = run_args(out_dir, model_dir, 1)
    distributed, rank, world, device = train.init_distributed(args.seed)
    _, model, ref_model = train.load_models(args, None, model_dir, device)
    optimizer = train.make_optimizer(model, args)
    scheduler, tokenizer = train.make_scheduler(optimizer, args), load_tokenizer(model_dir)
    if unshared:
        out_dir = os.path.join(out_dir, f"rank{rank}")
    os.makedirs(out_dir, exist_ok=True)
    try:
        save_checkpoint(out_dir, 1, model, optimizer, scheduler, tokenizer, args, ref_model)
    except CheckpointError as err:
        os.write(1, f"rank {rank}: {err}\n".encode())  # one write: the ranks share the pipe
        return
    real_save = torch.save

    def full_disk_on_rank_1(obj, f, *a, **k):
        if rank == 1 and not isinstance(f, (str, os.PathLike, io.BytesIO)):  # DCP's shard file, not a pickle
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    torch.save = full_disk_on_rank_1
    try:
        save_checkpoint(out_dir, 2, model, optimizer, scheduler, tokenizer, args, ref_model)
    except CheckpointError as err:
        os.write(1, f"rank {rank}: {err}\n".encode())  # one write: the ranks share the pipe


def model(model_dir, hidden, layers, dtype="float32"):
    """tools/tiny_model.py's model scaled to `hidden` x `layers`, so that a measurement is of megabytes; saved in
    `dtype` (bfloat16: loading it in float32 copies every tensor, as a hub model's load does)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.tiny_model import build_tokenizer

    tok, hidden = build_tokenizer(), int(hidden)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=int(layers),
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)


if __name__ == "__main__":
    job, *rest = sys.argv[1:]
    tasks.TASKS["digits"] = DigitTask()
    if job == "train":
        train.main(run_args(*rest))
        if "RANK" in os.environ:  # as train.py's __main__: skip C++ teardown, where a gloo thread aborted a rank in CI
            sys.stdout.flush()
            os._exit(0)
    else:
        jobs = {
            "load": load,
            "fail": fail,
            "unshared": lambda *a: fail(*a, unshared=True),
            "model": model,
            "measure-save": measure_save,
            "measure-load": measure_load,
            "measure-resume": measure_resume,
        }
        jobs[job](*rest)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
            sys.stdout.flush()
            os._exit(0)  # what each rank printed is out: skip C++ teardown, where a gloo thread once aborted rank 0
