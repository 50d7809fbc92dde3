"""Checkpoints of a train.py run: save, find, validate and restore (Appendix B.1's runs save every 100 steps).

A checkpoint is out_dir/checkpoint-STEP: a Hugging Face folder (`from_pretrained` and vLLM load it as
is) plus optimizer.pt (full, unsharded optimizer state) and trainer_state.pt (step, data position,
scheduler, every rank's RNG states, the run's arguments). It is written into a temporary folder and
renamed into place, and trainer_state.pt is what marks it complete, so a killed save never leaves a
half-written checkpoint behind. A damaged or foreign checkpoint raises CheckpointError with one line.

    python train.py --resume runs/arith-softmax-s0          # continue from the newest checkpoint
"""

import os
import random
import shutil
import tempfile
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line for the user."""


def find_checkpoint(path: str) -> str | None:
    """`path` itself if it is a checkpoint, else the newest complete checkpoint-STEP inside it."""
    if os.path.isfile(os.path.join(path, "trainer_state.pt")):
        return path
    done = [d for d in os.listdir(path) if d.startswith("checkpoint-") and d[11:].isdigit()
            and os.path.isfile(os.path.join(path, d, "trainer_state.pt"))] if os.path.isdir(path) else []
    return os.path.join(path, max(done, key=lambda d: int(d[11:]))) if done else None


def read_trainer_state(ckpt: str) -> dict:
    missing = [f for f in ("config.json", "optimizer.pt") if not os.path.isfile(os.path.join(ckpt, f))]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: missing {', '.join(missing)}")
    try:
        return torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    except Exception as err:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: cannot read trainer_state.pt "
                              f"({type(err).__name__})") from None


def save_checkpoint(out_dir, step, model, optimizer, scheduler, tokenizer, args):
    """out_dir/checkpoint-STEP: an HF folder (from_pretrained, vLLM) + optimizer.pt + trainer_state.pt.

    Written into a temporary folder and renamed into place, so a killed save never leaves a
    half-written checkpoint-STEP behind; trainer_state.pt is what marks a checkpoint complete.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)  # full tensors on rank 0
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    rngs = [rng]
    if dist.is_initialized():
        rngs = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, rng)
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = tempfile.mkdtemp(dir=out_dir, prefix=f".tmp-checkpoint-{step:06d}-")
        model.save_pretrained(tmp, state_dict=model_state)
        tokenizer.save_pretrained(tmp)
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
        torch.save({"step": step, "data_position": step * args.rollout_batch, "scheduler": scheduler.state_dict(),
                    "rng": rngs, "args": asdict(args)}, os.path.join(tmp, "trainer_state.pt"))
        final = os.path.join(out_dir, f"checkpoint-{step:06d}")
        if os.path.exists(final):  # move the old one aside first: a rename cannot replace a folder
            os.rename(final, tmp + "-old")
        os.rename(tmp, final)
        shutil.rmtree(tmp + "-old", ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(ckpt, model, optimizer, scheduler, rank) -> int:
    """Restore optimizer, scheduler and this rank's RNG states (the weights came with from_pretrained)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = read_trainer_state(ckpt)
    try:
        optim_state = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=False)
    except Exception as err:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: unreadable optimizer.pt ({type(err).__name__})") from None
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"][rank if rank < len(state["rng"]) else 0]  # another world size: rank 0's
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"] is not None:
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"]
