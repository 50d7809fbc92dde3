"""math-verify in a `python -c` child with a warm spare: its SIGALRM timeout works in the main thread only.

python -m pytest tests/test_rewards.py -q -k math
"""

import json
import os
import select
import subprocess
import sys
import threading

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


def _start() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )


def _reply(child: subprocess.Popen, timeout: float) -> bytes | None:
    """The child's next line, or None after `timeout` seconds or a death."""
    if not select.select([child.stdout], [], [], timeout)[0]:
        return None
    return child.stdout.readline().strip() or None


class MathWorker:
    """The active child plus a warm spare. Thread-safe."""

    def __init__(self, timeout: float, on_failure=lambda message: None):
        self.timeout, self.on_failure, self.lock = timeout, on_failure, threading.Lock()
        self.owner, self.active, self.spare, self.ready = os.getpid(), None, None, False

    def verify(self, pred: str, gold: str) -> float:
        with self.lock:
            if self.active is None or self.active.poll() is not None:
                self.active, self.spare, self.ready = self.spare or _start(), None, False
            self.spare = self.spare or _start()
            if not self.ready:  # sympy import: untimed
                self.ready = _reply(self.active, timeout=120) == b"ready"
                if not self.ready:
                    return self._fail(
                        "the math-verify worker failed to start, so math rewards are 0 "
                        f"(try `{sys.executable} -c 'import math_verify'`)"
                    )
            self.active.stdin.write(json.dumps([pred, gold]).encode() + b"\n")
            self.active.stdin.flush()
            line = _reply(self.active, timeout=self.timeout)
            if line is None:
                return self._fail(
                    f"a math-verify call took over {self.timeout:g} s and scored 0 (answer of {len(pred)} characters)"
                )
            return 1.0 if line == b"1" else 0.0

    def _fail(self, message: str) -> float:
        self.close(self.active)
        self.active = None
        self.on_failure(message)
        return 0.0

    def close(self, *children):
        """Kill `children` (default: both), not after a fork."""
        for child in children or (self.active, self.spare):
            if child is not None and self.owner == os.getpid():
                child.kill()
                child.wait()
