"""Checkpoints of a train.py run: save, find, validate and restore (Appendix B.1's runs save every 100 steps).

A checkpoint is out_dir/checkpoint-STEP:
- a Hugging Face folder of the policy (`from_pretrained` and vLLM load it as is): rank 0 writes it from the model's
  full state dict, the one gather a save makes (the model's weights alone, never the optimizer's state);
- trainer/, a torch.distributed.checkpoint (DCP) folder: each rank writes and reads its own shard of the policy,
  of AdamW's state and of a reference policy that a --reference variant moves, so no rank ever holds the whole
  optimizer. DCP reshards on load: a run saved on 2 ranks resumes on 1 or 4 (tests/test_dcp.py);
- trainer_state.pt (step, data position, scheduler, AdamW's hyperparameters, every rank's RNG states, the run's
  arguments), written last.
It is written into a temporary folder and renamed into place, and trainer_state.pt is what marks it complete, so a
killed save never leaves a half-written checkpoint behind. A damaged or foreign checkpoint raises CheckpointError
with one line. With --keep-checkpoints K, each successful save is followed by prune_checkpoints, which deletes all
but the newest K complete checkpoints (the paper presets keep 2, as the official configs' max_actor_ckpt_to_keep).

Checkpoints are shared, so loading one must not run code: trainer_state.pt is read with
torch.load(weights_only=True), which builds tensors, numbers, strings, lists and dicts and refuses every other
object (CheckpointError, one line); DCP's .metadata is unpickled with only DCP's own metadata classes allowed
(read_dcp_metadata), and its shards hold tensors alone, which DCP reads with weights_only=True. The RNG states are
stored in plain types (numpy's as a plain list); checkpoints written before that hold numpy's state as an array,
and load with exactly the four numpy names that rebuild one (NUMPY_RNG_GLOBALS).

    python train.py --resume runs/arith-softmax-s0          # continue from the newest checkpoint
"""

import contextlib
import glob
import os
import pickle
import random
import re
import shutil
import tempfile
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from plumbing.cli import first_line


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line for the user."""


# What np.random.get_state()'s uint32 array needs to unpickle, and nothing more: trainer_state.pt files
# written before the RNG states were stored as lists hold one (tests/test_bad_input.py).
_NUMPY_CORE = getattr(np, "_core", None) or np.core  # numpy 2 renamed np.core (requirements.txt allows 1.26)
NUMPY_RNG_GLOBALS = [_NUMPY_CORE.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def safe_load(ckpt: str, name: str):
    """torch.load(ckpt/name) with weights_only=True: a file that needs any other object is refused, unbuilt."""
    try:
        with torch.serialization.safe_globals(NUMPY_RNG_GLOBALS if name == "trainer_state.pt" else []):
            return torch.load(os.path.join(ckpt, name), weights_only=True)
    except pickle.UnpicklingError as err:
        needs = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if needs:
            raise CheckpointError(f"checkpoint {ckpt}: {name} needs {needs.group(1)} to load, and loading "
                                  "anything but tensors, numbers, strings, lists and dicts could run code; "
                                  "refused") from None
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: cannot read {name} (not a torch.save file "
                              "of tensors, numbers, strings, lists and dicts)") from None
    except Exception as err:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: cannot read {name} ({type(err).__name__})") from None


def rng_state() -> dict:
    """This process's RNG states as tensors, tuples and lists of numbers: they load under weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(rng: dict):
    kind, keys, pos, has_gauss, gauss = rng["numpy"]  # a list, or an array in older checkpoints
    random.setstate(rng["python"])
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"] is not None:
        set_cuda_rng_states(rng["cuda"])


def set_cuda_rng_states(states: list):
    """Each visible GPU's RNG state from the saved list, device i from states[i]. torch.cuda.set_rng_state_all
    fails when fewer GPUs are visible than at the save; the states that have a device are restored, and one line
    says what was not."""
    visible = torch.cuda.device_count()
    for i, state in enumerate(states[:visible]):
        torch.cuda.set_rng_state(state, i)
    if len(states) != visible:
        print(f"note: the checkpoint holds {len(states)} GPU RNG states and {visible} GPUs are visible: restored "
              f"{min(len(states), visible)}" + (f", the other {visible - len(states)} keep their seed"
                                                 if visible > len(states) else ""))


@contextlib.contextmanager
def kept_rng_state():
    """The RNG states as they were before the block: vLLM's engine set-up seeds the global RNGs, which would undo
    what load_checkpoint restored (tests/test_train.py::test_resume_restores_the_rng_after_an_engine_reseeds_it)."""
    rng = rng_state()
    yield
    set_rng_state(rng)


def model_file_error(folder: str) -> str | None:
    """Why a *.safetensors file in `folder` cannot load (empty, truncated, a damaged header), as one line, or None.

    Reads each file's header only (its first 8 bytes say how long the header is), so it costs milliseconds
    before a model load that would otherwise end in a traceback from inside safetensors.
    """
    import json
    import struct

    names = os.listdir(folder)
    pickled = sorted(f for f in names if f.endswith((".bin", ".pt", ".pth", ".ckpt")) and f.startswith(
        ("pytorch_model", "model")))
    if pickled and not any(f.endswith(".safetensors") for f in names):  # unpickling can run any code
        return (f"{folder} holds pickled weights ({', '.join(pickled)}), which can run code when loaded; convert "
                "them to model.safetensors (safetensors' convert script) and load that")
    for name in sorted(f for f in names if f.endswith(".safetensors")):
        path, why = os.path.join(folder, name), None
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None:
                why = f"{size} bytes: empty or cut short"
            elif 8 + length > size or length > 100_000_000:
                why = "a damaged header"
            else:
                try:
                    header = json.loads(f.read(length))
                    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
                except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                    why = "a damaged header"
                else:
                    if 8 + length + end != size:
                        why = f"{size:,} bytes where its header describes {8 + length + end:,}: cut short or damaged"
        if why:
            return f"model file {path} is corrupt ({why}); save or download the model again"
    return None


def complete_checkpoints(run: str) -> list[str]:
    """The names of the complete checkpoint-STEP folders in `run` (trainer_state.pt marks one), oldest step first."""
    done = [d for d in os.listdir(run) if d.startswith("checkpoint-") and d[11:].isdigit()
            and os.path.isfile(os.path.join(run, d, "trainer_state.pt"))] if os.path.isdir(run) else []
    return sorted(done, key=lambda d: int(d[11:]))


def find_checkpoint(path: str) -> str | None:
    """`path` itself if it is a checkpoint, else the newest complete checkpoint-STEP inside it."""
    if os.path.isfile(os.path.join(path, "trainer_state.pt")):
        return path
    done = complete_checkpoints(path)
    return os.path.join(path, done[-1]) if done else None


def resume_hint(out: str) -> str:
    """What an interrupted run leaves to continue from, in words: a save is atomic, so the newest is whole."""
    ckpt = find_checkpoint(out) if out else None
    return f"the newest checkpoint is {ckpt}: continue with --resume {out}" if ckpt else "no checkpoint was saved yet"


def newer_checkpoints(ckpt: str, step: int) -> list[str]:
    """The complete checkpoints beside `ckpt` (of step `step`) with a later step: resuming `ckpt` in place would
    overwrite them with another trajectory."""
    return [d for d in complete_checkpoints(os.path.dirname(os.path.abspath(ckpt))) if int(d[11:]) > step]


def resume_error(resume: str, out: str, given: dict, keeps: tuple[str, ...]) -> str | None:
    """Why continuing the checkpoint at --resume `resume` into run folder `out`, with the run's flags `given`
    (config.Args as a dict), would lose or mix runs, as one line, or None.

    --model never changes on resume; a moved or copied folder of the same model (folder_fingerprint) is the
    same --model. An older checkpoint resumed in its own run folder would overwrite the newer
    ones and cut metrics.jsonl (a fork into another --out-dir leaves the run alone). A changed flag of `keeps`
    (--task, --advantage, --M, the estimator's own hyperparameters) would continue one run as another, unless
    --resume-changed says it is deliberate.
    """
    ckpt = find_checkpoint(resume)
    if ckpt is None:
        return f"--resume {resume}: no checkpoint there"
    try:
        state = read_trainer_state(ckpt)
        saved, step = state["args"], int(state.get("step", 0))
    except CheckpointError as err:
        good = [d for d in complete_checkpoints(os.path.dirname(os.path.abspath(ckpt)))[:-1][::-1]
                if _readable(os.path.join(os.path.dirname(os.path.abspath(ckpt)), d))]
        fork = (f"; to go on from the last good one, fork it into a new folder: --resume "
                f"{os.path.join(os.path.dirname(ckpt), good[0])} --out-dir NEW") if good and ckpt != resume else ""
        return str(err) + fork
    moved = saved["model"] != given["model"] and state.get("model_fingerprint") is not None and \
        state["model_fingerprint"] == folder_fingerprint(given["model"])  # the same model, moved or copied
    if saved["model"] != given["model"] and not moved or (saved["task"] != given["task"]
                                                          and not given["resume_changed"]):
        return (f"checkpoint {ckpt} is from task {saved['task']} / model {saved['model']}, not task "
                f"{given['task']} / model {given['model']}; pass the same --task and --model (or a moved or "
                "copied folder of that model) to resume")
    run = os.path.dirname(os.path.abspath(ckpt))
    newer = newer_checkpoints(ckpt, step)
    evaluated = given["eval_examples"] == 0 or "after" in _json(os.path.join(os.path.dirname(ckpt), "eval.json"))
    if given["steps"] < step or given["steps"] == step and evaluated:  # at the end, only the last score may be due
        return (f"--steps {given['steps']}: checkpoint {ckpt} is already at step {step}, so there is nothing to "
                f"train; pass --steps above {step} to continue it")
    if newer and os.path.realpath(out) == os.path.realpath(run):
        return (f"--resume {ckpt}: {run} holds newer checkpoints ({', '.join(newer)}), which resuming an older one "
                f"there would overwrite; resume {run} (its newest), or fork into a new run with --out-dir NEW")
    for name in () if given["resume_changed"] else keeps:
        if name in saved and saved[name] != given[name]:
            flag = "--" + name.replace("_", "-")
            return (f"checkpoint {ckpt} was trained with {flag} {saved[name]}, not {given[name]}; "
                    f"pass {flag} {saved[name]} to resume it, --resume-changed to change it, or start a new run")
    try:  # before any model loads: DCP's metadata that needs more than its own classes is refused
        read_dcp_metadata(ckpt)
    except CheckpointError as err:
        return str(err)
    return None


TRAINER = "trainer"  # checkpoint-STEP/trainer: the DCP folder, one shard file per saving rank and a .metadata


def read_trainer_state(ckpt: str) -> dict:
    missing = [f for f in ("config.json", f"{TRAINER}/.metadata") if not os.path.isfile(os.path.join(ckpt, f))]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: missing {', '.join(missing)}")
    state = safe_load(ckpt, "trainer_state.pt")
    if not isinstance(state, dict) or not isinstance(state.get("args"), dict):
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: trainer_state.pt holds no run arguments")
    return state


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(map(_tensor_bytes, obj.values()))
    return sum(map(_tensor_bytes, obj)) if isinstance(obj, (list, tuple)) else 0


def _size(n_bytes: float) -> str:
    """Bytes as a reader wants them: 1.23 GB, 45.6 MB, 789 kB (a tiny model's checkpoint is not '0.00 GB')."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{int(n_bytes)} bytes"


def remove_orphans(out_dir: str, master: bool = True) -> list[str]:
    """Remove the .tmp-checkpoint-* folders that killed saves or deletions (prune_checkpoints) left in `out_dir`
    (they can fill a disk), on rank 0 only, and say so in one note; their names. A checkpoint that a save killed
    between its two renames had moved aside, with no new one of its step in place, comes back instead."""
    if not master or not os.path.isdir(out_dir):
        return []
    names = sorted(d for d in os.listdir(out_dir) if d.startswith(".tmp-checkpoint-"))
    saves = sorted({m[1] for m in map(re.compile(r"\.tmp-(checkpoint-\d+)-").match, names) if m})
    if restored := [back for name in saves if (back := _undo_save(os.path.join(out_dir, name)))]:
        print(f"note: put back {', '.join(restored)} as its checkpoint-STEP in {out_dir}: a save killed mid-way had "
              "moved it aside")
    names = [name for name in names if name not in restored]
    for name in names:  # what _undo_save left: any odd name
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    if names:
        print(f"note: removed {len(names)} unfinished checkpoint save(s) or deletion(s) a killed run left in "
              f"{out_dir}: {', '.join(names)}")
    return names


# DCP's metadata pickle names only these: its own metadata classes, torch.Size, dtypes, a layout, a path.
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"}, "torch": {"Size"}, "pathlib": {"PosixPath", "Path"},
    "collections": {"OrderedDict"}, "builtins": {"set", "frozenset"}}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in DCP_METADATA_GLOBALS.get(module, ()) or module == "torch" and isinstance(
                getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def read_dcp_metadata(ckpt: str):
    """checkpoint-STEP/trainer/.metadata, unpickled with DCP_METADATA_GLOBALS alone: DCP's own reader would
    unpickle anything, and a shared checkpoint must not run code (CheckpointError, one line)."""
    name = f"{TRAINER}/.metadata"
    try:
        with open(os.path.join(ckpt, name), "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        needs = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if needs:
            raise CheckpointError(f"checkpoint {ckpt}: {name} needs {needs.group(1)} to load, and loading anything "
                                  "but DCP's metadata could run code; refused") from None
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: cannot read {name}") from None
    except Exception as err:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: cannot read {name} ({type(err).__name__})") from None


def _reader(ckpt: str):
    """DCP's file reader of checkpoint-STEP/trainer, its metadata read by read_dcp_metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_dcp_metadata(ckpt)
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(os.path.join(ckpt, TRAINER))


def sharded_state(model, optimizer, ref_model=None) -> tuple[dict, list]:
    """(what DCP saves and loads, AdamW's param_groups). The first holds tensors only, each rank's own shards
    (FSDP2's DTensors) or the whole tensors in one process: "model", "optimizer" (AdamW's step and moments by
    parameter name) and, for a reference a --reference variant moves, "reference". The param_groups (lr, betas,
    ...) are plain numbers: they go to trainer_state.pt, which loads without running code (DCP unpickles what is
    not a tensor). On a fresh optimizer get_state_dict first creates the zero moments that a load fills in."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state["state"]}
    if ref_model is not None:
        state["reference"] = get_model_state_dict(ref_model)
    return state, optim_state["param_groups"]


@contextlib.contextmanager
def one_process_quiet():
    """DCP warns at every save and load in one process that it assumes one process, which is what we ask of it."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _agree(reason: str | None, src: int | None = None) -> str | None:
    """The same verdict on every rank: `src`'s reason, or (src None) the first rank's that has one."""
    if not dist.is_initialized():
        return reason
    if src is not None:
        verdict = [reason]
        dist.broadcast_object_list(verdict, src=src)
        return verdict[0]
    reasons = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r), None)


def _first_failure(err: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (its failures: rank -> (exception, trace)).
    DCP wraps a Ctrl-C (any BaseException that is not an error) as it wraps a full disk: that one is raised again as
    itself, so the run reports an interrupt, never a failed save or a corrupt checkpoint."""
    failures = getattr(err, "failures", None)
    inner = next(iter(failures.values()))[0] if failures else err
    if not isinstance(inner, Exception):
        raise inner from None
    return inner


@contextlib.contextmanager
def _undone_if_interrupted(out_dir: str, step: int, master: bool):
    """A Ctrl-C mid-save leaves what was there before (`_undo_save`), then goes on as the interrupt it is."""
    try:
        yield
    except Exception:
        raise
    except BaseException:
        if master:  # rank 0 alone touches the folders, as when it saves
            _undo_save(os.path.join(out_dir, f"checkpoint-{step:06d}"))
        raise


def _undo_save(final: str) -> str | None:
    """Back to what was there before a save of `final` began, after it failed, was interrupted or killed: its
    temporary folder goes, and a checkpoint of the same step that was moved aside for it comes back (its name)."""
    put_back = None
    for tmp in glob.glob(os.path.join(os.path.dirname(final), f".tmp-{os.path.basename(final)}-*")):
        if tmp.endswith("-old") and not os.path.exists(final):
            with contextlib.suppress(OSError):
                os.rename(tmp, final)
                put_back = os.path.basename(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return put_back


def _why(err: BaseException) -> str:
    return (getattr(err, "strerror", None) or first_line(err, limit=None))[:200]


def save_checkpoint(out_dir, step, model, optimizer, scheduler, tokenizer, args, ref_model=None):
    """out_dir/checkpoint-STEP: an HF folder (from_pretrained, vLLM) + trainer/ (DCP) + trainer_state.pt.
    `ref_model`: a reference that a --reference variant moves (its state is saved), or None.

    Every rank writes its own shards into trainer/ at once, so no rank waits on another's gather; then the model's
    full weights are gathered to rank 0 (the model alone), which writes the HF folder and trainer_state.pt. All of
    it goes into a temporary folder renamed into place, so a killed save never leaves a half-written
    checkpoint-STEP behind; trainer_state.pt is what marks a checkpoint complete. A save that fails on any rank (a
    full disk, an unwritable folder) removes its temporary folder and raises CheckpointError on every rank, one
    line naming the save, the bytes it needed and the last good checkpoint, which it left intact. A Ctrl-C leaves
    the folder as it was before the save and goes on as the interrupt it is. A save that succeeded is followed by
    prune_checkpoints(out_dir, args.keep_checkpoints) on rank 0, which the other ranks do not wait for.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    master = not dist.is_initialized() or dist.get_rank() == 0
    final, tmp, reason = os.path.join(out_dir, f"checkpoint-{step:06d}"), None, None
    with _undone_if_interrupted(out_dir, step, master):
        if master:
            try:
                tmp = tempfile.mkdtemp(dir=out_dir, prefix=f".tmp-checkpoint-{step:06d}-")
            except OSError as err:  # the run folder made read-only, or gone, mid-run
                reason = f"cannot write in {out_dir}: {_why(err)}"
        if dist.is_initialized():  # the other ranks write their shards into rank 0's temporary folder
            where = [tmp, reason]
            dist.broadcast_object_list(where, src=0)
            tmp, reason = where
        state, param_groups = sharded_state(model, optimizer, ref_model)
        if reason is None:
            try:  # DCP's own collectives make every rank raise when any rank's write fails
                with one_process_quiet():
                    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, TRAINER)),
                             no_dist=not dist.is_initialized())
            except (Exception, CheckpointException) as err:  # DCP's is a BaseException, holding each rank's error
                reason = _why(_first_failure(err))
            reason = _agree(reason)
        rngs = [rng_state()]
        if dist.is_initialized():
            rngs = [None] * dist.get_world_size()
            dist.all_gather_object(rngs, rng_state())
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # the model's full tensors, on rank 0 only
        model_state = get_model_state_dict(model, options=full) if reason is None else {}
        if master and reason is None:
            try:
                model.save_pretrained(tmp, state_dict=model_state)
                tokenizer.save_pretrained(tmp)
                torch.save({"step": step, "data_position": step * args.rollout_batch,
                            "scheduler": scheduler.state_dict(), "param_groups": param_groups, "rng": rngs,
                            "args": asdict(args),
                            "reference": ref_model is not None, "world": len(rngs),
                            "model_fingerprint": folder_fingerprint(args.model)}, os.path.join(tmp, "trainer_state.pt"))
                if os.path.exists(final):  # move the old one aside first: a rename cannot replace a folder
                    os.rename(final, tmp + "-old")
                os.rename(tmp, final)
                shutil.rmtree(tmp + "-old", ignore_errors=True)
            except Exception as err:  # ENOSPC as OSError, or torch.save's RuntimeError "unexpected pos"
                reason = _why(err)
    error = None
    if master and reason is not None:
        _undo_save(final)  # the old one of the same step back in place
        last_good = find_checkpoint(out_dir) if os.path.isdir(out_dir) else None
        needed = _tensor_bytes(state) + _tensor_bytes(state["model"])  # DTensors count whole: the HF copy too
        free = f"{_size(shutil.disk_usage(out_dir).free)} are free" if os.path.isdir(out_dir) else "its folder is gone"
        error = (f"saving checkpoint {final} failed ({reason}): it needs about {_size(needed)} and {free}; its "
                 "partial folder is removed, and " + (f"the last good checkpoint, {last_good}, is intact"
                                                      if last_good else "no earlier checkpoint exists"))
    error = _agree(error, src=0)  # every rank learns rank 0's verdict (and waits for its HF folder)
    if error:
        raise CheckpointError(error)
    try:  # after the verdict, on rank 0: the other ranks go on training meanwhile
        prune_checkpoints(out_dir, getattr(args, "keep_checkpoints", 0), master)
    except OSError as err:  # an old checkpoint that cannot go costs disk, not the run
        print(f"note: could not delete old checkpoints in {out_dir} ({err.strerror or type(err).__name__}); kept")


def prune_checkpoints(out_dir: str, keep: int, master: bool = True) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints in `out_dir` (0: delete nothing), on rank 0 only; the
    names deleted. save_checkpoint calls it right after a save succeeded (a failed one raises before it).

    Only complete checkpoint-STEP folders count and go, newest by step kept: a failed save leaves no new one, so
    the last good checkpoint always stays, and the checkpoint a --resume started from goes only once `keep` newer
    ones exist. .tmp-checkpoint-* and incomplete folders are not checkpoints and are left alone. Each is renamed
    to a .tmp-checkpoint-* name before its files go: a kill mid-delete then leaves a folder that find_checkpoint
    never picks and remove_orphans clears at the next start, not a half-deleted checkpoint-STEP that still holds
    its trainer_state.pt. The other ranks never read the run folder, so they do not wait for this.
    """
    if keep < 0:
        raise ValueError(f"keep_checkpoints must be >= 0 (0: keep all), got {keep}")
    if not master or keep == 0:
        return []
    deleted = []
    for name in complete_checkpoints(out_dir)[:-keep]:
        path = os.path.join(out_dir, name)
        if os.path.islink(path):  # a link to a checkpoint kept elsewhere: not this run's to delete
            continue
        trash = tempfile.mkdtemp(dir=out_dir, prefix=f".tmp-{name}-deleted-")
        try:
            os.rename(path, trash)  # atomic, and replaces the empty folder mkdtemp made
        except OSError as err:  # a checkpoint that cannot go costs disk, not the run
            os.rmdir(trash)
            print(f"note: could not delete old checkpoint {path} ({err.strerror or type(err).__name__}); kept")
            continue
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(name)
    return deleted


def _json(path: str) -> dict:
    import json

    try:
        with open(path) as f:
            found = json.load(f)
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def _readable(ckpt: str) -> bool:
    try:
        read_trainer_state(ckpt)
        return True
    except CheckpointError:
        return False


def changed_flags(ckpt: str, given: dict) -> str:
    """The flags a resume of `ckpt` changes, "--lr 0.001 -> 1e-05, ..." (its own bookkeeping flags left out)."""
    saved = read_trainer_state(ckpt)["args"]
    own = ("resume", "resume_changed", "out_dir", "steps", "plan", "plan_gpus", "plan_gpu_gb")
    return ", ".join(f"--{name.replace('_', '-')} {saved[name]} -> {value}" for name, value in given.items()
                     if name not in own and name in saved and saved[name] != value)


def load_checkpoint(ckpt, model, optimizer, scheduler, rank, lr=None, weight_decay=None, ref_model=None) -> int:
    """Restore this rank's shards of the policy and AdamW's state (DCP reads only them, resharding when the world
    size changed), the scheduler, this rank's RNG states, and `ref_model` (a reference a --reference variant
    moves) where the checkpoint holds one; a checkpoint of a frozen run leaves it at the initial model.

    `lr`, `weight_decay`: the run's flags, which replace the saved ones (the optimizer's state holds them), so
    that a resume with a new --lr trains at it; the schedule (warmup) continues from the saved step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = read_trainer_state(ckpt)
    read_dcp_metadata(ckpt)  # here, on every rank: inside dcp.load a refusal would be a traceback per rank
    own = [{k: group[k] for k in ("fused", "foreach", "capturable") if k in group} for group in optimizer.param_groups]
    shards, _ = sharded_state(model, optimizer, ref_model if state.get("reference") else None)
    try:
        with one_process_quiet():
            dcp.load(shards, storage_reader=_reader(ckpt), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as err:
        inner = _first_failure(err)
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: cannot read {TRAINER}/ ({type(inner).__name__}: "
                              f"{first_line(inner, limit=120)})") from None
    set_state_dict(model, optimizer, model_state_dict=shards["model"],
                   optim_state_dict={"state": shards["optimizer"], "param_groups": state["param_groups"]})
    if "reference" in shards:
        set_model_state_dict(ref_model, shards["reference"])
    scheduler.load_state_dict(state["scheduler"])
    for i, (group, mine) in enumerate(zip(optimizer.param_groups, own)):
        group.update(mine)  # this run's kernel choice (fused in one process, not on FSDP2's shards), not the save's
        if lr is not None:  # LambdaLR: lr = base_lr * lambda(step), as at each of its steps
            scheduler.base_lrs[i] = group["initial_lr"] = lr
            group["lr"] = lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
        if weight_decay is not None:
            group["weight_decay"] = weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
    set_rng_state(state["rng"][rank if rank < len(state["rng"]) else 0])  # another world size: rank 0's
    return state["step"]


def folder_fingerprint(path: str) -> str | None:
    """What identifies a model folder wherever it lies (None: not a folder, e.g. a hub id or an alias): a digest of
    config.json and, per weights file, its name, size and first and last MiB. A moved or copied folder keeps it;
    another model (even one fine-tuned from the same) does not. A resume compares it, never the path."""
    import hashlib

    if not os.path.isdir(path):
        return None
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name == "config.json" or name.endswith((".safetensors", ".bin")):
            file = os.path.join(path, name)
            size = os.path.getsize(file)
            with open(file, "rb") as f:
                digest.update(f"{name}:{size}:".encode() + f.read(1 << 20))
                f.seek(max(size - (1 << 20), 0))
                digest.update(f.read(1 << 20))
    return digest.hexdigest()
