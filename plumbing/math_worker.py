"""math-verify in a `python -c` child with a warm spare: its SIGALRM timeout works in the main thread only, so the
timeout is ours (a select on the reply, counting the child's CPU seconds) and a child that overruns it is killed,
the spare taking over.

python -m pytest tests/test_rewards.py -q -k math
"""

import json
import os
import select
import sys
import threading
import time
from subprocess import DEVNULL, PIPE, Popen

WALL_FACTOR = 10  # a child that neither answers nor computes for this many timeouts is stuck, not slow

_WORKER = r"""
import functools, json, sys
reply, sys.stdout = sys.stdout, sys.stderr  # keep library prints off the reply channel
from math_verify import parse, verify
parse_gold = functools.lru_cache(10000)(lambda gold: parse(gold, parsing_timeout=None))
verify(parse("\\boxed{\\frac12}", parsing_timeout=None), parse("0.5", parsing_timeout=None),
       timeout_seconds=None)  # lazy parser set-up happens here, not inside the first timed call
print("ready", file=reply, flush=True)
for line in sys.stdin:
    pred, gold = json.loads(line)
    try:
        ok = verify(parse_gold(gold), parse(pred, parsing_timeout=None), timeout_seconds=None)
    except Exception:
        ok = False
    print(int(ok), file=reply, flush=True)
"""


def _start() -> Popen:
    # stderr to DEVNULL: the library's warnings and tracebacks would flood the run's own output
    return Popen([sys.executable, "-c", _WORKER], stdin=PIPE, stdout=PIPE, stderr=DEVNULL)


def _cpu_seconds(child: Popen) -> float | None:
    """The CPU seconds `child` has used (Linux /proc), or None where they cannot be read."""
    try:
        with open(f"/proc/{child.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in clock ticks


def _reply(child: Popen, timeout: float) -> bytes:
    """The child's next line; b"" once it has spent `timeout` CPU seconds on it, or a death (EOF).
    CPU seconds, not wall seconds: on a loaded machine a call within the limit would otherwise score 0.
    Where CPU time cannot be read, `timeout` wall seconds end the wait; for a child that waits without
    computing, `WALL_FACTOR` x `timeout` wall seconds."""
    start_cpu = _cpu_seconds(child)
    deadline = time.monotonic() + WALL_FACTOR * timeout
    spent = 0.0
    while spent < timeout:
        # the child is single-threaded: its CPU time grows no faster than the clock, so this waits at least
        # the CPU seconds it has left
        readable, _, _ = select.select([child.stdout], [], [], timeout - spent)  # a hung call never blocks training
        if readable:
            return child.stdout.readline().strip()
        now_cpu = _cpu_seconds(child)
        if start_cpu is None or now_cpu is None or time.monotonic() > deadline:
            return b""
        spent = now_cpu - start_cpu
    return b""


class MathWorker:
    """The active child plus a warm spare. Thread-safe: a caller may score from any thread."""

    def __init__(self, timeout: float, on_failure):
        self.timeout = timeout
        self.on_failure = on_failure
        self.lock = threading.Lock()  # one request in flight: replies carry no id
        self.active = self.spare = None

    def verify(self, pred: str, gold: str) -> float:
        with self.lock:
            if self.active is None or self.active.poll() is not None:  # none yet, or it died: the spare takes over
                self.active = self.spare or _start()
                self.spare = _start()  # warm while the active one works: a kill costs no sympy import
                # the first reply waits out the sympy import, untimed
                if _reply(self.active, timeout=120) != b"ready":
                    return self._fail(
                        "the math-verify worker failed to start, so math rewards are 0 "
                        f"(try `{sys.executable} -c 'import math_verify'`)"
                    )
            self.active.stdin.write(json.dumps([pred, gold]).encode() + b"\n")
            self.active.stdin.flush()
            line = _reply(self.active, timeout=self.timeout)
            if not line:
                return self._fail(
                    f"a math-verify call took over {self.timeout:g} CPU seconds and scored 0 "
                    f"(answer of {len(pred)} characters)"
                )
            return float(line == b"1")

    def _fail(self, message: str) -> float:
        self.close(self.active)
        self.active = None
        self.on_failure(message)
        return 0.0

    def close(self, *children):
        """Kill `children` (default: both)."""
        for child in children or (self.active, self.spare):
            if child is not None:
                child.kill()
                child.wait()  # reaped: no zombie per timeout
