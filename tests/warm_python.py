"""`python train.py FLAGS` for the command-line tests, without paying for `import torch, transformers` (about 9 s)
each time: a server process imports train.py's and eval.py's modules once, then forks a fresh child per command.
The child is a new process as `python SCRIPT` would be (its own exit code, stdout, stderr, signals and globals);
only the imports are shared. It runs no torch op before forking, so no thread pool is copied into a child.

    from warm_python import run_script
    result = run_script("train.py", "--M", "0")   # a subprocess.CompletedProcess
    result = run_script("-m", "tools.memory_plan", "--model", "smollm2-135m")
"""

import json
import os
import select
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"HF_HUB_OFFLINE": "1"}  # read when huggingface_hub is imported: fixed for the server's life
_server = None


def serve():
    """Read one JSON request per line ({"argv", "out", "err"}); answer each with the child's exit code."""
    sys.path[:0] = [ROOT]
    import runpy

    import eval  # noqa: F401  (the imports the children share)
    import train  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd, path in ((1, request["out"]), (2, request["err"])):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                if request["argv"][0] == "-m":  # python -m MODULE FLAGS
                    sys.argv = request["argv"][1:]
                    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = request["argv"]
                    runpy.run_path(sys.argv[0], run_name="__main__")
                code = 0
            except SystemExit as err:
                code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
                if isinstance(err.code, str):
                    print(err.code, file=sys.stderr)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


def run_script(script, *flags, timeout=300, env=None) -> subprocess.CompletedProcess:
    """`python SCRIPT FLAGS` (or `python -m MODULE FLAGS`) in ROOT with ENV set, forked from the warm server
    (started on first use); a plain subprocess when `env` sets more than ENV, which the server cannot change."""
    global _server
    if not (env or {}).items() <= ENV.items():
        return subprocess.run(
            [sys.executable, script, *map(str, flags)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **ENV, **env},
        )
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, __file__],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **ENV},
        )
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        argv = [script, *map(str, flags)]
        _server.stdin.write(json.dumps({"argv": argv, "out": out, "err": err}) + "\n")
        _server.stdin.flush()
        if not select.select([_server.stdout], [], [], timeout)[0]:
            _server.kill()  # and its child with it: the next call starts a new server
            raise subprocess.TimeoutExpired(argv, timeout)
        code = int(_server.stdout.readline())
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(argv, code, o.read(), e.read())


if __name__ == "__main__":
    serve()
