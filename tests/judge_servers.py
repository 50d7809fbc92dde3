"""OpenAI-compatible servers for the judge tests: a real vLLM server, and a scripted one.

`VLLMServer` starts `vllm.entrypoints.openai.api_server` from .venv-vllm on 127.0.0.1 and stops its
whole process group on exit, even when the test fails. `ScriptedServer` speaks the same two routes
(GET /v1/models, POST /v1/chat/completions) from the standard library, answering with a function of
the request, so the fast tests can drive answers, delays and failures the judge must survive.
"""

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.environ.get("SOFTMAX_GRPO_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if pytest itself is killed, when no `finally` can run."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG (Linux)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`with VLLMServer(model_dir, name, log_path) as server:` starts vLLM's OpenAI-compatible server;
    `server.wait_until_up()` blocks until it answers. Leaving the block stops its whole process group,
    whether the test passed or failed."""

    def __init__(
        self, model_dir: str, name: str, log_path: str, *, max_model_len: int = 4096, start_timeout: float = 600
    ):
        self.port, self.log_path, self.start_timeout = free_port(), log_path, start_timeout
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.command = [
            VLLM_PYTHON,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--served-model-name",
            name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(max_model_len),
            "--enforce-eager",
            "--seed",
            "0",
        ]

    def __enter__(self):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
        self.start = time.monotonic()
        with open(self.log_path, "w") as log:
            # a session of its own: the API server spawns an engine process, and both must go on exit
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return self

    def wait_until_up(self) -> float:
        """Seconds from the start until GET /v1/models answered."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; its log: {self.log_path}")
            if time.monotonic() - self.start > self.start_timeout:
                raise RuntimeError(f"vLLM server not up after {self.start_timeout:.0f} s; its log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as response:
                    if response.status == 200:
                        return time.monotonic() - self.start
            except OSError:
                time.sleep(0.5)

    def __exit__(self, *exc):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # the engine process, should it outlive its parent
            os.killpg(self.proc.pid, signal.SIGKILL)


class ScriptedServer:
    """A local OpenAI-compatible chat server whose answer is `answer(model, messages)`.

    `answer` may return a string (the reply), or an int HTTP status to fail that request with.
    `delay` seconds pass before each reply; with `trickle`, the reply's body is sent one byte every `trickle`
    seconds. `requests` logs (model, messages) of every chat request,
    `max_in_flight` the most requests it held at once.
    """

    def __init__(self, answer, models=("judge",), delay: float = 0.0, trickle: float = 0.0):
        self.answer, self.models, self.delay, self.trickle = answer, list(models), delay, trickle
        self.requests, self.in_flight, self.max_in_flight = [], 0, 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest's output clean
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not server.trickle or self.command == "GET":
                    self.wfile.write(data)
                    return
                for i in range(len(data)):  # headers at once, then the body a byte at a time
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
                    time.sleep(server.trickle)

            def do_GET(self):
                if self.path.rstrip("/") == "/v1/models":
                    self._send(
                        200,
                        {
                            "object": "list",
                            "data": [
                                {"id": m, "object": "model", "created": 0, "owned_by": "test"} for m in server.models
                            ],
                        },
                    )
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((body["model"], body["messages"]))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    time.sleep(server.delay)
                    reply = server.answer(body["model"], body["messages"])
                finally:
                    with server.lock:
                        server.in_flight -= 1
                if isinstance(reply, int):
                    self._send(reply, {"error": {"message": f"scripted failure {reply}"}})
                    return
                self._send(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply}}
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    },
                )

        class Server(ThreadingHTTPServer):
            request_queue_size = 64  # the default listen backlog (5) refuses a burst of concurrent requests
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
