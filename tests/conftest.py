import pytest
from tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of the tiny random-weight test model (built once per test session)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))
