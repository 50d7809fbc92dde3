"""Files written whole or not at all, and write checks.
python -m pytest tests/test_bad_input.py -k "disk or unwritable"
"""

import contextlib
import errno
import json
import os
import tempfile

from plumbing.cli import first_line


class CheckpointError(Exception):
    """One line on a checkpoint or a run's own file (plumbing/checkpoint.py, plumbing/run_log.py)."""


class WriteError(OSError):
    """One line; the file is as it was."""


def _write_failed(verb: str, path: str, err: OSError, kept: str) -> WriteError:
    why = "is the disk full or failing?"  # EIO and the rest
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        why = "is the disk full?"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "its folder is not writable (made read-only during the run?)"
    return WriteError(f"cannot {verb} {path} ({err.strerror or first_line(err)}): {why} {kept}")


def write_whole(path: str, write) -> None:
    """`write(f)` to a temp file, fsync, rename over `path`: a crash or a full disk leaves the old file whole."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")  # same folder: the rename is atomic; pid: no clash
    try:
        with open(tmp, "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data on disk before the rename names it: no empty file after a power cut
        os.replace(tmp, path)
        fsync(folder)  # the rename itself on disk: after a power cut the name points at the new file, not the old
    except OSError as err:
        raise _write_failed("write", path, err, "The file is as it was before.") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # gone after the rename; after a failure (any exception), no temp file stays


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    for root, _, names in os.walk(folder, topdown=False):
        for name in names:
            fsync(os.path.join(root, name))
        fsync(root)


def write_json(path: str, obj, indent: int | None = None) -> None:
    write_whole(path, lambda f: json.dump(obj, f, indent=indent))


def write_jsonl(path: str, rows) -> None:
    """JSON Lines: one object a line."""
    write_whole(path, lambda f: f.writelines(json.dumps(row) + "\n" for row in rows))


def append_jsonl(path: str, rows) -> None:
    """All or none."""
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            done = 0
            while done < len(data):  # os.write may write part
                done += os.write(fd, data[done:])
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)  # no torn last line for a resume to meet
            raise
        finally:
            os.close(fd)
    except OSError as err:
        kept = "The file is as it was before this step, and the last checkpoint is intact"
        raise _write_failed("append to", path, err, kept) from None


def write_error(path: str, flag: str, folder: bool = False) -> str | None:
    """Why `path` (folder=True: a folder) cannot be written, or None."""
    try:  # else the save would fail after training
        path.encode("utf-8")
    except UnicodeEncodeError:
        return f"{flag} {os.fsencode(path)!r} is not UTF-8 text: pass a path in UTF-8"
    if folder:
        if os.path.islink(path) and not os.path.exists(path):
            return f"{flag} {path} is a link to {os.readlink(path)}, which does not exist"
        parent = os.path.abspath(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)  # the nearest existing folder above: makedirs will start there
        if not os.path.isdir(parent):  # `path` itself, or a folder above it, is a file
            return f"{flag} {path}: {parent} is a file, not a folder"
    elif os.path.isdir(path):
        return f"{flag} {path} is a folder; pass a file path"
    elif not os.path.isdir(parent := os.path.dirname(os.path.abspath(path))):
        return f"cannot write {path}: its folder {parent} does not exist (or is a file); pass {flag} PATH"
    try:  # a real file made and removed: os.access says yes to root whatever the mode bits say
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".write-check-")
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        return (
            f"{flag} {path}: cannot write in {parent} ({err.strerror})"
            if folder
            else f"cannot write {path}: {parent} is not writable ({err.strerror}); pass {flag} PATH"
        )
