import os

# pytest -n 2 runs two workers on the two cores, and some tests start more processes: a torch thread pool each
# would spin on cores another process holds (63 s -> 35 s for two test files). Set before anything imports torch;
# the workers and every subprocess inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from tools.tiny_model import build_tiny_model

# A reward that raises is a bug: in tests it fails the test instead of scoring 0 (rewards.py's docstring).
# Set before any test module imports rewards; subprocesses (torchrun, vLLM workers) inherit it.
os.environ.setdefault("SOFTMAX_GRPO_STRICT_REWARDS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of the tiny random-weight test model (built once per test session)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(autouse=True)
def hub_answers(monkeypatch):
    """No test reaches the Hugging Face Hub: the start-up probe (plumbing/data.py: hub_reachable, which a hub id
    in --model or a preset asks) answers yes, so parsing a paper preset does not hang on, or fail by, this
    machine's network. A test of the unreachable case patches it to False, or runs a subprocess against a dead
    HF_ENDPOINT (test_nothing_silent)."""
    from plumbing import data

    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: True)


@pytest.fixture(autouse=True)
def no_training_curves(request, monkeypatch):
    """train.py ends by drawing curves.png, about 3 s of matplotlib, more than a tiny run's training: a test that
    runs train.main in this process skips it, unless the test is marked `curves`."""
    if request.node.get_closest_marker("curves") is None:
        import tools.figures

        monkeypatch.setattr(tools.figures, "plot_training_curves", lambda paths, out, **kwargs: out)
