"""Files written whole or not at all, and whether a path can be written: for train.py, eval.py and the run log.

A write goes to a hidden temporary file beside its target, reaches the disk (fsync) and is renamed over it: a full
disk leaves the earlier file whole. An append that fails is cut back to the old length: no torn last line.
"""

import contextlib
import errno
import json
import os
import tempfile

from plumbing.cli import first_line


class WriteError(OSError):
    """A write that did not happen (a full disk, a folder made read-only during a run), as one line; the file is
    as it was. `strerror` is the system's reason ("Permission denied")."""

    def __init__(self, message: str, strerror: str | None = None):
        super().__init__(message)
        self.strerror = strerror


def _write_failed(verb: str, path: str, err: OSError, kept: str) -> WriteError:
    why = ("its folder is not writable (made read-only during the run?)" if err.errno in (errno.EACCES, errno.EPERM,
           errno.EROFS) else "is the disk full?" if err.errno in (errno.ENOSPC, errno.EDQUOT) else
           "is the disk full or failing?")
    return WriteError(f"cannot {verb} {path} ({err.strerror or first_line(err)}): {why} {kept}", err.strerror)


def write_whole(path: str, write) -> None:
    """`write(f)` on a temporary text file beside `path` (one file system), flushed to the disk and renamed into
    place; a failing disk or folder is a one-line WriteError."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(err, OSError) and not isinstance(err, WriteError):
            raise _write_failed("write", path, err, "The file is as it was before.") from None
        raise


def write_json(path: str, obj, indent: int | None = None) -> None:
    write_whole(path, lambda f: json.dump(obj, f, indent=indent))


def write_lines(path: str, lines) -> None:
    """Text lines, each ending in its own newline (JSON Lines rows, say)."""
    write_whole(path, lambda f: f.writelines(lines))


def append_lines(path: str, lines) -> None:
    """Text lines added at the end of `path`, all or none (WriteError, one line)."""
    data = "".join(lines).encode()
    kept = "The file is as it was before this step, and the last checkpoint is intact"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise _write_failed("append to", path, err, kept) from None
    try:  # unbuffered: nothing is left to flush at close
        size = os.lseek(fd, 0, os.SEEK_END)
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError as err:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise _write_failed("append to", path, err, kept) from None
    finally:
        os.close(fd)


def write_error(path: str, flag: str, folder: bool = False) -> str | None:
    """Why `path` cannot be written, as one line naming `flag`, or None: a file to write (eval.py --out), or with
    folder=True a folder to write in, made later if missing (train.py --out-dir). A probe file is made and removed
    where the writes will go, so a read-only folder costs a second, not a run."""
    try:  # a path the file system takes but UTF-8 cannot write: the save would fail after the training
        path.encode("utf-8")
    except UnicodeEncodeError:
        return f"{flag} {os.fsencode(path)!r} is not UTF-8 text: pass a path in UTF-8"
    if folder:
        if os.path.islink(path) and not os.path.exists(path):
            return f"{flag} {path} is a link to {os.readlink(path)}, which does not exist"
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{flag} {path} is a file, not a folder"
        parent = os.path.abspath(path)
        while not os.path.exists(parent):  # the nearest existing parent, where the folder will be made
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            return f"{flag} {path}: {parent} is a file, not a folder"
    elif os.path.isdir(path):
        return f"{flag} {path} is a folder; pass a file path"
    elif not os.path.isdir(parent := os.path.dirname(os.path.abspath(path))):
        return f"cannot write {path}: its folder {parent} does not exist (or is a file); pass {flag} PATH"
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".write-check-")
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        return (f"{flag} {path}: cannot write in {parent} ({err.strerror})" if folder else
                f"cannot write {path}: {parent} is not writable ({err.strerror}); pass {flag} PATH")
    return None
