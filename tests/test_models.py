"""plumbing/models.py: a model that cannot be loaded is one line naming it, --model and HF_HUB_OFFLINE."""

from pathlib import Path

import huggingface_hub.constants
import pytest

from plumbing.models import ModelLoadError, load_model, load_tokenizer


@pytest.mark.parametrize("kind", ["missing", "empty", "hub id offline", "config without weights"])
@pytest.mark.parametrize("load", [load_model, load_tokenizer])
def test_unloadable_model_is_one_line(kind, load, tmp_path, monkeypatch, tiny_model_dir):
    # the hub id case fails at once instead of after ~23 s of retries; huggingface_hub reads the variable once,
    # at import, so its module constant is what an in-process test can set
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    if kind == "missing":
        path = str(tmp_path / "no-such-model")
    elif kind == "empty":
        path = str(tmp_path)
    elif kind == "hub id offline":
        path = "nobody-13/not-a-cached-model"
    else:  # for load_tokenizer this is one more folder without tokenizer files
        (tmp_path / "config.json").write_text((Path(tiny_model_dir) / "config.json").read_text())
        path = str(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message and len(message) < 600
    assert message.startswith(f"cannot load model {path!r}")
    assert "--model" in message and "HF_HUB_OFFLINE" in message
    assert isinstance(info.value, OSError)  # callers that catch OSError keep working


def test_loadable_model_still_loads(tiny_model_dir):
    model = load_model(tiny_model_dir)
    assert model.config._attn_implementation == "eager"
    assert load_tokenizer(tiny_model_dir).eos_token_id is not None


def test_a_host_load_keeps_the_weights_in_host_memory_with_the_devices_attention(tiny_model_dir):
    """Issue 64, item 3: under torchrun rank 0 read the whole float32 policy and reference onto its GPU before
    shard() cut them; now it reads them into host memory (shard() moves each rank's shards), while the attention is
    the GPU's own (sdpa), as the other ranks' empty builds choose it."""
    model = load_model(tiny_model_dir, device="cuda", host=True)  # no CUDA needed: nothing moves to it
    assert {p.device.type for p in model.parameters()} == {"cpu"} and model.config._attn_implementation == "sdpa"
    assert load_model(tiny_model_dir).config._attn_implementation == "eager"  # a CPU run's own choice
