"""train.py checkpoints (HF folder, DCP shards, trainer_state.pt): save, find, check, restore, prune; the run folder.
python -m pytest tests/test_checkpoint.py
"""

import contextlib
import fcntl
import glob
import io
import os
import pickle
import random
import re
import shutil
import signal
import warnings
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.utils._pytree import tree_leaves

from plumbing.cli import first_line, flag
from plumbing.files import CheckpointError, fsync, fsync_tree, write_error
from plumbing.parallel import full_weights, gather_objects, tied_names
from plumbing.run_log import read_evals, read_log

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process, as we ask of it


# What DCP's .metadata pickle may name: its own classes and a few builtins, nothing that runs code
DCP_METADATA_GLOBALS = {
    "torch.Size",
    "torch.serialization._get_layout",
    "pathlib.PosixPath",
    "builtins.set",
    "collections.OrderedDict",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
}


UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")  # torch's weights_only refusal, and ours below


class _MetadataUnpickler(pickle.Unpickler):  # DCP's own reader unpickles anything
    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or f"{module}.{name}" in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def safe_load(ckpt: str, name: str):
    """Load ckpt/name without running code; else CheckpointError."""
    try:
        if name.endswith(".metadata"):
            with open(os.path.join(ckpt, name), "rb") as f:
                return _MetadataUnpickler(f).load()
        return torch.load(os.path.join(ckpt, name), weights_only=True)
    except Exception as err:
        if needs := UNSUPPORTED_GLOBAL.search(str(err)):  # the unpicklers' refusal
            raise CheckpointError(
                f"checkpoint {ckpt}: {name} needs {needs.group(1)} to load, and loading anything "
                "but tensors, numbers, strings, lists and dicts could run code; refused"
            ) from None
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: cannot read {name} ({type(err).__name__})") from None


def read_trainer_state(ckpt: str) -> dict:
    """trainer_state.pt, or CheckpointError."""
    missing = [f for f in ("config.json", "trainer/.metadata") if not os.path.isfile(os.path.join(ckpt, f))]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: missing {', '.join(missing)}")
    metadata = safe_load(ckpt, "trainer/.metadata")  # refused here, before DCP's own reader unpickles it
    # DCP reads a byte entry with torch.load(weights_only=False), which can run code; our saves write tensors only
    entries = getattr(metadata, "state_dict_metadata", {})
    byte_entries = [name for name, entry in entries.items() if isinstance(entry, BytesStorageMetadata)]
    if byte_entries:
        raise CheckpointError(
            f"checkpoint {ckpt}: trainer/.metadata holds {len(byte_entries)} pickled entries (e.g. {byte_entries[0]}), "
            "which DCP would unpickle and which could run code; a checkpoint train.py saves holds tensors only; refused"
        )
    state = safe_load(ckpt, "trainer_state.pt")
    if not isinstance(state, dict) or not isinstance(state.get("args"), dict):  # a file torch wrote, but not train.py
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: trainer_state.pt holds no run arguments")
    return state


def rng_state() -> dict:
    """Plain types, so weights_only loads them."""
    numpy = list(np.random.get_state())
    numpy[1] = numpy[1].tolist()  # the Mersenne Twister's keys: weights_only loads a list, not an array
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(rng: dict):
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"] is not None:  # a CPU-saved run resumed on a GPU: no GPU state saved
        torch.cuda.set_rng_state(rng["cuda"])


@contextlib.contextmanager
def kept_rng_state():
    """vLLM's set-up reseeds the global RNGs: the ones a checkpoint saves come back as they were."""
    rng = rng_state()
    yield
    set_rng_state(rng)


def _step(name: str) -> int:
    return int(name[11:])


def complete_checkpoints(run: str) -> list[str]:
    """Oldest first; a save's trainer_state.pt is written last, so a folder without it is no checkpoint."""
    names = [os.path.dirname(p) for p in glob.glob("checkpoint-*/trainer_state.pt", root_dir=run)]
    return sorted([name for name in names if name[11:].isdigit()], key=_step)  # checkpoint-best is a user's, not ours


def find_checkpoint(path: str) -> str | None:
    """`path`, or its newest checkpoint."""
    if os.path.isfile(os.path.join(path, "trainer_state.pt")):
        return path
    done = complete_checkpoints(path)
    if not done:
        return None
    return os.path.join(path, done[-1])


def run_of(ckpt: str) -> str:
    """The run folder that holds checkpoint folder `ckpt`."""
    return os.path.dirname(os.path.abspath(ckpt))


def resume_hint(out: str) -> str:
    ckpt = find_checkpoint(out)
    if ckpt is None:
        return "no checkpoint was saved yet"
    return f"the newest checkpoint is {ckpt}: continue with --resume {out}"


def resume_error(resume: str, out: str, given: dict, keeps: tuple[str, ...], fixed: tuple[str, ...] = ()) -> str | None:
    """Why this resume would lose or mix runs, or None; `keeps`: flags only --resume-changed changes (--model too);
    `fixed`: those of them that not even --resume-changed changes."""
    ckpt = find_checkpoint(resume)
    if ckpt is None:
        return f"--resume {resume}: no checkpoint there"
    run = run_of(ckpt)
    try:
        state = read_trainer_state(ckpt)
    except CheckpointError as err:
        older = complete_checkpoints(run)[:-1]
        if ckpt == resume or not older:  # a checkpoint named by the user, or the run's only one
            return str(err)
        before = os.path.join(os.path.dirname(ckpt), older[-1])
        return f"{err}; to go on from the one before, fork it into a new folder: --resume {before} --out-dir NEW"
    saved = state["args"]
    step = int(state.get("step", 0))
    differ = [name for name in ("model", *keeps) if name in saved and saved[name] != given[name]]
    unmovable = [name for name in differ if name in fixed]
    if unmovable:  # the trainer state holds the optimizer state of the weights trained, by name and shape
        name = unmovable[0]
        return (
            f"checkpoint {ckpt} was trained with {flag(name)} {saved[name]}, not {given[name]}, which even "
            f"--resume-changed cannot change: its trainer state is of those weights; start a new run from its "
            f"policy with --model {ckpt}"
        )
    if differ and not given["resume_changed"]:  # a run mixed of two settings would be no one run's result
        name = differ[0]
        return (
            f"checkpoint {ckpt} was trained with {flag(name)} {saved[name]}, not {given[name]}; "
            f"pass {flag(name)} {saved[name]} to resume it, --resume-changed to change it (e.g. the model folder "
            "moved), or start a new run"
        )
    try:  # the run's own files, read back before any model loads
        evaluated = given["eval_examples"] == 0 or "after" in read_evals(run)
        for name in ("metrics.jsonl", "completions.jsonl"):
            read_log(os.path.join(out, name), note=False)
    except CheckpointError as err:
        return str(err)
    if given["steps"] < step or given["steps"] == step and evaluated:  # a finished run is not trained on
        return (
            f"--steps {given['steps']}: checkpoint {ckpt} is already at step {step}, so there is nothing to "
            f"train; pass --steps above {step} to continue it"
        )
    newer = [name for name in complete_checkpoints(run) if _step(name) > step]
    if newer and os.path.realpath(out) == os.path.realpath(run):  # the next save would overwrite a newer one
        return (
            f"--resume {ckpt}: {run} holds newer checkpoints ({', '.join(newer)}), which resuming an older one "
            f"there would overwrite; resume {run} (its newest), or fork into a new run with --out-dir NEW"
        )


def untied(model, state: dict) -> dict:
    """Each tensor once: a tied head is saved under the embedding's name alone."""
    tied = tied_names(model)
    return {k: v for k, v in state.items() if k not in tied}


def sharded_state(model, optimizer, ref_model=None) -> dict:
    """DCP state with each tensor once; creates a fresh optimizer's moments. No param_groups: make_optimizer builds
    them from the flags, and load_checkpoint sets the scheduled lr. A frozen weight (LoRA's base) is left out: it
    never changes, and a resume reads it from the run's --model (train.load_models)."""
    trained_only = dcp_state.StateDictOptions(ignore_frozen_params=True)
    model_state, optim_state = dcp_state.get_state_dict(model, optimizer, options=trained_only)
    state = {"model": untied(model, model_state), "optimizer": optim_state["state"]}
    if ref_model is not None:
        state["reference"] = untied(ref_model, dcp_state.get_model_state_dict(ref_model))
    return state


def _reason(err: BaseException) -> str:
    """A failure in a few words: the first rank's own exception in DCP's wrapper; re-raises a Ctrl-C."""
    failures = getattr(err, "failures", None)
    inner = next(iter(failures.values()))[0] if failures else err
    if not isinstance(inner, Exception):
        raise inner from None
    reason = getattr(inner, "strerror", None) or first_line(inner, limit=None)
    return reason[:200]


def _attempt(write) -> str | None:
    """None, or why `write()` failed."""
    try:
        write()
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        return _reason(err)
    return None


def _any_rank(reason: str | None) -> str | None:
    """The first rank's reason on every rank: all ranks fail a save together, or none does."""
    return next(filter(None, gather_objects([reason])), None)


def _unloadable(state) -> str | None:
    """Why torch.load(weights_only=True), as a resume reads trainer_state.pt, would refuse `state`, or None."""
    if not state:  # a stateless rollout's {}
        return None
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as err:
        needs = UNSUPPORTED_GLOBAL.search(str(err))
        return f"it needs {needs.group(1)}" if needs else first_line(err, limit=200)
    return None


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM wait, then arrive as the block ends: the interrupt line, after a whole save. Held by a
    handler, not by a signal mask: a mask holds only this thread, and Python runs a signal that another thread
    takes in this one at once."""
    caught = []

    def hold(taken, frame):
        if caught:  # a second one means it: a save that hangs on a dead rank still stops
            raise KeyboardInterrupt
        caught.append(taken)

    held = (signal.SIGINT, signal.SIGTERM)
    handlers = {number: signal.signal(number, hold) for number in held}
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        if caught:
            signal.raise_signal(caught[0])  # to the handler it was meant for


def save_checkpoint(out_dir, step, model, optimizer, scheduler, tokenizer, args, ref_model=None, rollout=None):
    """Any rank's failure is one CheckpointError on all, the folder unchanged."""
    master = not dist.is_initialized() or dist.get_rank() == 0
    final = os.path.join(out_dir, f"checkpoint-{step:06d}")
    tmp = os.path.join(out_dir, f".tmp-checkpoint-{step:06d}-save")  # a name every rank knows; a killed save's orphan
    reason = error = None
    with signals_held():  # torch.save, DCP's writer included, turns an interrupt inside it into an I/O error
        rollout_state = getattr(rollout, "state_dict", dict)()
        if unloadable := _any_rank(_unloadable(rollout_state)):  # found at the first save, not at every resume
            raise CheckpointError(
                f"--rollout {args.rollout}: its state_dict() holds what a resume cannot load ({unloadable}); "
                "keep it to tensors, numbers, strings, lists and dicts"
            )

        def shards():  # each rank writes its own into rank 0's folder
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(os.path.join(tmp, "trainer")),
                no_dist=not dist.is_initialized(),
            )

        def publish():  # rank 0: the HF folder, then trainer_state.pt, then the rename that marks the save complete
            trainer_state = {
                "step": step,
                "scheduler": scheduler.state_dict(),
                "rng": rngs,
                "args": asdict(args),
                "reference": ref_model is not None,
                "rollout": rollout_state,
            }
            base = model.get_base_model() if args.lora_rank else model
            base.save_pretrained(tmp, state_dict=weights)
            tokenizer.save_pretrained(tmp)
            torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt"))  # torch.save's ENOSPC is "unexpected pos"
            fsync_tree(tmp)  # durable before the rename marks it complete
            os.rename(tmp, final)
            fsync(out_dir)

        try:
            if master and (failed := _attempt(lambda: os.mkdir(tmp))):
                reason = f"cannot write in {out_dir}: {failed}"
            reason = _any_rank(reason)  # also a barrier: rank 0's folder exists before the others look for it
            if reason is None and not os.path.isdir(tmp):
                reason = (
                    f"rank {dist.get_rank()} on {os.uname().nodename} does not see rank 0's {tmp}: put "
                    "--out-dir on a filesystem that every node shares"
                )
            reason = _any_rank(reason)
            state = sharded_state(model, optimizer, ref_model)
            if reason is None:
                reason = _any_rank(_attempt(shards))
            rngs = gather_objects([rng_state()])
            if reason is None:  # every rank gathers each tensor, rank 0 keeps it; LoRA's merged, under the base names
                weights = {name: t.cpu() for name, t in full_weights(model) if master}
                if master:
                    reason = _attempt(publish)
            if master and reason is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                tensors = [t for t in tree_leaves([state, state["model"]]) if isinstance(t, torch.Tensor)]
                needed = sum(t.nbytes for t in tensors) / 1e6  # DCP's shards and the HF folder's copy of the model
                free = shutil.disk_usage(out_dir).free / 1e6 if os.path.isdir(out_dir) else 0
                good = find_checkpoint(out_dir)
                kept = f"the last good checkpoint, {good}, is intact" if good else "no earlier checkpoint exists"
                error = (
                    f"saving checkpoint {final} failed ({reason}): it needs about {needed:,.1f} MB and {free:,.1f} MB "
                    f"are free; its partial folder is removed, and {kept}"
                )
            error = _any_rank(error)
        except BaseException:  # a Ctrl-C mid-save leaves the folder as it was
            if master:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    if error:
        raise CheckpointError(error)
    try:
        prune_checkpoints(out_dir, args.keep_checkpoints, master)
    except OSError as err:  # costs disk, not the run
        print(f"note: could not delete old checkpoints in {out_dir} ({err.strerror or type(err).__name__}); kept")


def remove_orphans(out_dir: str, master: bool = True) -> list[str]:
    """A killed save or prune leaves a .tmp- folder that nothing reads: the next start clears it."""
    names = sorted(glob.glob(".tmp-checkpoint-*", root_dir=out_dir)) if master else []
    for name in names:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    if names:
        print(
            f"note: removed {len(names)} unfinished checkpoint save(s) or deletion(s) a killed run left in "
            f"{out_dir}: {', '.join(names)}"
        )
    return names


def prune_checkpoints(out_dir: str, keep: int, master: bool = True) -> list[str]:
    """Keep the newest `keep` (0: all); rename, then delete: no half-deleted checkpoint."""
    deleted = complete_checkpoints(out_dir)[:-keep] if master and keep else []
    for name in deleted:
        gone = os.path.join(out_dir, f".tmp-{name}-deleted")
        os.rename(os.path.join(out_dir, name), gone)
        shutil.rmtree(gone, ignore_errors=True)
    return deleted


def load_checkpoint(ckpt, model, optimizer, scheduler, rank, args, ref_model=None, rollout=None):
    """Restore (resharded) and the --rollout entry's state; the step. This run's --lr and --weight-decay win; rank 0
    names the flags that differ from the saved run's."""
    state = read_trainer_state(ckpt)  # before DCP unpickles
    own = ("resume", "resume_changed", "out_dir", "steps", "plan", "plan_gpus", "plan_gpu_gb")  # a resume's own
    before = state["args"]
    changed = [
        f"{flag(k)} {before[k]} -> {v}" for k, v in asdict(args).items() if k not in own and before.get(k, v) != v
    ]
    if rank == 0 and changed:
        print(f"resume: continuing {ckpt} with changed flags: {', '.join(changed)}")
    if not state.get("reference"):  # a run without a moving reference saved none
        ref_model = None
    shards = sharded_state(model, optimizer, ref_model)  # the live tensors: DCP loads into them in place
    try:
        reader = dcp.FileSystemReader(os.path.join(ckpt, "trainer"))
        dcp.load(shards, storage_reader=reader, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: cannot read trainer/ ({_reason(err)})") from None
    # this run's --lr wins (its --weight-decay is the fresh AdamW's already): its base_lrs, at the saved step
    saved = {**state["scheduler"], "base_lrs": scheduler.base_lrs}
    saved["last_epoch"] -= 1
    scheduler.load_state_dict(saved)
    scheduler.step()  # back to the saved step, setting each group's lr = base_lr * lambda(step)
    saved_rank = rank if rank < len(state["rng"]) else 0  # more ranks than saved: the new ones take rank 0's
    set_rng_state(state["rng"][saved_rank])
    if hasattr(rollout, "load_state_dict"):
        if not state.get("rollout"):  # a run of a stateless rollout saved none
            raise CheckpointError(
                f"checkpoint {ckpt} holds no state for --rollout {args.rollout} (it was saved by --rollout "
                f"{before.get('rollout')}): resume with that --rollout, or start a new run with --model {ckpt}"
            )
        rollout.load_state_dict(state["rollout"])
    return state["step"]


def run_dir(args) -> str:
    """--out-dir, --resume's folder or runs/TASK-ADVANTAGE-sSEED."""
    if args.out_dir:
        return args.out_dir
    ckpt = find_checkpoint(args.resume) if args.resume else None
    if ckpt is None:
        return f"runs/{args.task}-{args.advantage}-s{args.seed}"
    return run_of(ckpt)


@contextlib.contextmanager
def lock_run_folder(out: str, hold: bool = True):
    """One run per folder: flock out/.lock (dies with the process), else CheckpointError; yields whether held."""
    if not hold:  # torchrun's other ranks: rank 0 holds the one lock for them all
        yield False
        return
    made = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, ".lock"), "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            raise CheckpointError(
                f"--out-dir {out} is in use by a running train.py ({holder or 'another process'}); wait for it to "
                "end, or pick another --out-dir"
            ) from None
        except OSError as err:  # NFS nolock, Lustre
            print(f"note: {out} cannot be locked ({err.strerror}); nothing stops a second run there")
            hold = False
        else:  # who holds it, for the second run's message
            handle.truncate(0)
            handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
            handle.flush()
        try:
            yield hold
        finally:  # a run refused at once leaves no empty folder behind
            with contextlib.suppress(OSError):
                if made and os.listdir(out) == [".lock"]:
                    os.remove(os.path.join(out, ".lock"))
                    os.rmdir(out)


def run_folder_error(out: str, resume_ckpt: str | None) -> str | None:
    """Why `out` cannot hold this run, or None."""
    error = write_error(out, "--out-dir", folder=True)
    if error:
        return error
    names = os.listdir(out) if os.path.isdir(out) else []
    taken = any(name == "metrics.jsonl" or name.startswith("checkpoint-") for name in names)
    if taken and resume_ckpt is None:
        return f"{out} already holds a run: continue it with --resume {out}, or pick another --out-dir"
    if taken and os.path.realpath(out) != os.path.realpath(run_of(resume_ckpt)):
        return (
            f"--out-dir {out} already holds another run: resuming {resume_ckpt} there would overwrite it; pick a "
            "new --out-dir to fork into"
        )
