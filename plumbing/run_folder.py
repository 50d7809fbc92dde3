"""train.py's run folder: locked to one run, checked writable before any model loads.
    python -m pytest tests/test_bad_input.py -k "out_dir or held_folder or runs_folder"
"""

import contextlib
import fcntl
import os

from plumbing.checkpoint import find_checkpoint
from plumbing.files import write_error


def run_dir(args) -> str:
    """--out-dir, --resume's folder or runs/TASK-ADVANTAGE-sSEED."""
    if args.out_dir:
        return args.out_dir
    ckpt = find_checkpoint(args.resume) if args.resume else None
    return os.path.dirname(os.path.abspath(ckpt)) if ckpt else f"runs/{args.task}-{args.advantage}-s{args.seed}"


class RunFolderError(RuntimeError):
    """One-line message."""


class RunLock:
    """release() removes it if made here and left empty."""

    def __init__(self, out: str, handle, made: bool):
        self.out, self.handle, self.made = out, handle, made

    def release(self):
        if self.handle is not None:
            self.handle.close()
        with contextlib.suppress(OSError):
            if self.made and os.listdir(self.out) == [".lock"]:
                os.remove(os.path.join(self.out, ".lock"))
                os.rmdir(self.out)


def lock_run_folder(out: str, hold: bool = True) -> RunLock:
    """flock out/.lock (dies with the process), else RunFolderError."""
    if not hold:
        return RunLock(out, None, False)
    made = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    handle = open(os.path.join(out, ".lock"), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RunFolderError(f"--out-dir {out} is in use by a running train.py ({holder}); wait for it to end, or "
                             "pick another --out-dir") from None
    except OSError as err:  # NFS nolock, Lustre
        handle.close()
        print(f"note: {out} cannot be locked ({err.strerror}); nothing stops a second run there")
        return RunLock(out, None, made)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    handle.flush()
    return RunLock(out, handle, made)


def run_folder_error(out: str, resume_ckpt: str | None) -> str | None:
    """Why `out` cannot hold this run, or None."""
    if error := write_error(out, "--out-dir", folder=True):
        return error
    taken = os.path.isdir(out) and any(f == "metrics.jsonl" or f.startswith("checkpoint-") for f in os.listdir(out))
    if taken and resume_ckpt is None:
        return f"{out} already holds a run: continue it with --resume {out}, or pick another --out-dir"
    if taken and os.path.realpath(out) != os.path.realpath(os.path.dirname(os.path.abspath(resume_ckpt))):
        return (f"--out-dir {out} already holds another run: resuming {resume_ckpt} there would overwrite it; pick a "
                "new --out-dir to fork into")
    return None
