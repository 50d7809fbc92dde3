"""math-verify in a long-lived child process, so every math reward is bounded in time (rewards.py, note 1).

math-verify bounds its own time with SIGALRM, which only works in the main thread. Here it runs in a
`python -c` child (not multiprocessing: it then works from threads, forked and daemonic workers, and
scripts without a `__main__` guard) that answers one JSON line per call, with a warm spare beside it.
A call slower than the timeout kills the child and scores 0; the spare takes over at once. Every such 0
is reported through `on_failure` (rewards.py counts it in reward/errors): a score that depends on the
machine's load must not pass unseen.

    python -m pytest tests/test_rewards.py -q -k math
"""

import json
import os
import select
import subprocess
import sys
import threading

_WORKER = r"""
import json, sys
reply, sys.stdout = sys.stdout, sys.stderr  # keep library prints off the reply channel
from math_verify import parse, verify
golds = {}
verify(parse("\\boxed{\\frac12}", parsing_timeout=None), parse("0.5", parsing_timeout=None),
       timeout_seconds=None)  # lazy parser set-up happens here, not inside the first timed call
reply.write("ready\n"); reply.flush()
for line in sys.stdin:
    pred, gold = json.loads(line)
    try:
        if gold not in golds:
            if len(golds) > 10000:
                golds.clear()
            golds[gold] = parse(gold, parsing_timeout=None)
        ok = verify(golds[gold], parse(pred, parsing_timeout=None), timeout_seconds=None)
    except Exception:
        ok = False
    reply.write("1\n" if ok else "0\n"); reply.flush()
"""


class _Child:
    """One `python -c _WORKER` process and the reply lines it has sent."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.owner, self.buffer, self.ready = os.getpid(), b"", False

    def readline(self, timeout: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:  # the child died
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def kill(self):
        if self.owner == os.getpid():  # never the parent's child after a fork
            self.proc.kill()
            self.proc.wait()


class MathWorker:
    """The active child plus a warm spare, so a kill costs the next call nothing. Thread-safe."""

    def __init__(self, timeout: float, on_failure=lambda why: None):
        self.timeout, self.lock, self.active, self.spare = timeout, threading.Lock(), None, None
        self.on_failure = on_failure  # called with one line whenever a call scores 0 without a verdict

    def verify(self, pred: str, gold: str) -> float:
        """1.0 when math-verify says `pred` equals `gold` within the timeout, else 0.0."""
        with self.lock:
            if self.active is None or self.active.proc.poll() is not None:
                self.active, self.spare = self.spare or _Child(), None
            self.spare = self.spare or _Child()
            if not self.active.ready:  # first call: importing sympy takes a second or two
                if self.active.readline(timeout=120) != b"ready":
                    self.active.kill()
                    self.active = None
                    self.on_failure("the math-verify worker failed to start, so math rewards are 0 "
                                    f"(try `{sys.executable} -c 'import math_verify'`)")
                    return 0.0
                self.active.ready = True
            self.active.proc.stdin.write(json.dumps([pred, gold]).encode() + b"\n")
            self.active.proc.stdin.flush()
            line = self.active.readline(timeout=self.timeout)
            if line is None:  # too slow (or crashed): the spare takes over, this answer scores 0
                self.active.kill()
                self.active = None
                self.on_failure(f"a math-verify call took over {self.timeout:g} s and scored 0 "
                                f"(answer of {len(pred)} characters)")
                return 0.0
            return 1.0 if line == b"1" else 0.0

    def close(self):
        for child in (self.active, self.spare):
            if child is not None:
                child.kill()
