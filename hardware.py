"""The machine at hand: the attention kernel, bf16 units, what backward keeps and the CPU allocator.

Apart from has_bf16_units, which picks bf16 autocast for `train.py --dtype auto`, nothing here changes a
number the algorithm computes: each choice is held equal to the plain version by a test (named in the
SPEED TRICK or MEMORY TRICK line above it), and the README's "Measured" section says what each bought.
A model that cannot be loaded raises ModelLoadError, one line naming the model, --model and HF_HUB_OFFLINE.

    python -m pytest tests/test_loss.py tests/test_train.py -k "eager or bf16 or freed_memory or recast or recompute"
"""

import itertools
import os

import torch
from torch.utils.checkpoint import checkpoint


class ModelLoadError(OSError):
    """A one-line, user-facing model problem: no such folder, no weights, or no hub to download from."""


def model_load_error(path, err: BaseException) -> ModelLoadError:
    """The one line for a model `path` that cannot be loaded: names it, --model and HF_HUB_OFFLINE."""
    lines = str(err).strip().splitlines()
    reason = f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]
    where = ("a local folder, but not a loadable model" if os.path.isdir(str(path)) else
             "not a local folder, and not on the Hugging Face Hub or in its local cache")
    return ModelLoadError(f"cannot load model {str(path)!r}: {where} ({reason}). Pass --model with a Hugging Face "
                          "model folder, a checkpoint folder written by train.py or the alias smollm2-135m; a hub id "
                          "needs network access, or HF_HUB_OFFLINE=1 and the model in the local cache")


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


# ---- SPEED TRICK (skippable): bf16 storage of a frozen model; tests/test_train.py::test_bf16_reference_is_exact
def store_linears_bf16(model):
    """Keep a frozen model's nn.Linear weights in bfloat16, in place.

    Under bf16 autocast F.linear casts its weight to bf16 anyway, so the forward is bit-identical to
    float32 storage (tests/test_train.py::test_bf16_reference_is_exact) while the reference takes half
    the memory and skips the per-call cast. Embeddings and norms run outside autocast's cast list and
    stay float32; so does an lm_head tied to the embedding.

    Those float32 tensors are then copied into ordinary memory. from_pretrained maps the safetensors file
    and keeps its tensors in that mapping; the mapping lives while any of them does, and with it every
    page of the file the cast above read, so one float32 embedding left in it would keep the size of the
    whole float32 model resident (tests/test_train.py::test_bf16_reference_releases_the_weights_file).
    """
    embedding = model.get_input_embeddings().weight
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not embedding:
            module.to(torch.bfloat16)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.dtype != torch.bfloat16:
            tensor.data = tensor.data.clone()  # off the file mapping, so the mapping can close
    return model


# ---- MEMORY TRICK (skippable): recast weights in backward; tests/test_train.py::test_recast_linears_*
class _LinearRecastInBackward(torch.autograd.Function):
    """F.linear under bf16 autocast (no bias), saving the float32 weight instead of its bf16 cast.

    The same matmuls as autocast's F.linear and its backward, so the same bits; the backward casts the
    weight again (a cheap elementwise pass) rather than keeping the cast alive from forward to backward.
    """

    @staticmethod
    def forward(ctx, x, weight):
        x16 = x.to(torch.bfloat16)  # what autocast does to both operands
        ctx.save_for_backward(x16, weight)  # weight: the parameter itself, no new memory
        ctx.x_dtype = x.dtype
        return torch.matmul(x16, weight.to(torch.bfloat16).t())

    @staticmethod
    def backward(ctx, grad):
        x16, weight = ctx.saved_tensors
        w16, g = weight.to(torch.bfloat16), grad.reshape(-1, grad.shape[-1])  # (N, out)
        # The calls autograd makes for mm(x16, w16.t()): grad_x = g @ w16; grad_w = g^T @ x16 (then to fp32)
        grad_x = g.mm(w16).view(*grad.shape[:-1], w16.shape[1]).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grad_w = g.t().mm(x16.reshape(-1, x16.shape[-1])).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def _linear_forward(self, x):
    recast = (self.bias is None and self.weight.dtype == torch.float32 and torch.is_grad_enabled()
              and self.weight.requires_grad and torch.is_autocast_enabled(x.device.type)
              and torch.get_autocast_dtype(x.device.type) == torch.bfloat16)
    return _LinearRecastInBackward.apply(x, self.weight) if recast else torch.nn.functional.linear(
        x, self.weight, self.bias)


def recast_linears_in_backward(model):
    """Make the model's bias-free nn.Linear layers keep their float32 weight, not a bf16 copy, for backward.

    Under bf16 autocast each linear layer's forward casts its float32 weight to bf16 and autograd keeps
    that copy until the layer's backward: 2 bytes per parameter for the whole model from forward to
    backward, every micro-batch (0.27 GB for SmolLM2-135M; 2.9 GiB per rank for Qwen2.5-1.5B under FSDP2,
    where the gathered weights are cast). Recasting in backward costs one more cast per layer and changes
    no number: the forward and both gradients are bit-identical to autocast's
    (tests/test_train.py::test_recast_linears_in_backward_is_bit_identical). Elsewhere (float32, no grad,
    a layer with a bias) the layer runs its plain forward. In place; returns the model.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = _linear_forward.__get__(module)
    return model


# ---- MEMORY TRICK (skippable): recompute norms and the gate in backward; tests/test_train.py::test_recompute_*
def _gate(act_fn, gate, up):
    return act_fn(gate) * up


def _gated_mlp_forward(self, x):  # LlamaMLP / Qwen2MLP.forward, with the elementwise gate recomputed
    gate_up = (self.act_fn, self.gate_proj(x), self.up_proj(x))
    if not torch.is_grad_enabled():
        return self.down_proj(_gate(*gate_up))
    return self.down_proj(checkpoint(_gate, *gate_up, use_reentrant=False, preserve_rng_state=False))


def _recomputed_norm_forward(self, x):
    if not torch.is_grad_enabled():
        return type(self).forward(self, x)
    return checkpoint(type(self).forward, self, x, use_reentrant=False, preserve_rng_state=False)


def recompute_norms_and_gates_in_backward(model):
    """Keep only the inputs of each RMSNorm and of each MLP's act_fn(gate) * up, and rerun them in backward.

    They are elementwise and cheap to rerun, but autograd keeps their intermediates for backward: an RMSNorm
    keeps its float32 normalised output and 1/rms beside its input (4 bytes x (hidden + 1) per token more,
    twice a layer), the gate keeps act_fn(gate) beside gate and up (2 bytes x intermediate per token under
    bf16). Rerunning them (torch.utils.checkpoint on these few ops, not on the layer) keeps about a fifth of
    SmolLM2-135M's activations off the peak (memory_plan.py counts what stays) and changes no number: the
    rerun computes the same ops on the same inputs (tests/test_train.py::
    test_recompute_norms_and_gates_is_bit_identical). For a policy without enable_grad_checkpointing, which
    already reruns whole layers. In place; returns the model.
    """
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _recomputed_norm_forward.__get__(module)
        elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            module.forward = _gated_mlp_forward.__get__(module)
    return model


def configure_backward(model, *, bf16: bool, checkpointing: bool):
    """What the policy keeps for backward, as train.load_models sets it up (before FSDP2 wraps the layers):
    whole layers rerun with `checkpointing`, else the norms and MLP gates; under bf16 autocast, linear
    weights recast in backward. The benches and tests that measure train.py's backward call this too."""
    if checkpointing:
        enable_grad_checkpointing(model)
    else:
        recompute_norms_and_gates_in_backward(model)
    if bf16:
        recast_linears_in_backward(model)
    return model


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


# ---- SPEED TRICK (skippable): glibc keeps freed memory; only the allocator changes, no number computed
# (tests/test_train.py::test_keep_freed_memory_stops_refaulting_large_blocks checks that the pages are reused)
def keep_freed_memory() -> bool:
    """Ask glibc to serve large blocks from its heap and never hand freed memory back to the OS.

    By default every block over the mmap threshold is a fresh mapping, so each micro-batch's logits and
    log-prob chunks (50-100 MB each) are page-faulted and zeroed anew, and the kernel's page faulting
    becomes a large share of an update step. Reusing the heap's pages avoids that; the cost is that the
    heap never shrinks, so resident memory stays at its high-water mark.
    A no-op (False) where the C library is not glibc.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


# ---- MEMORY TRICK (skippable): free heap pages back to the OS once a step; only the allocator changes
# (tests/test_train.py::test_release_freed_memory_hands_kept_pages_back)
def release_freed_memory() -> bool:
    """Hand the pages of glibc's free blocks back to the OS now (malloc_trim); False where not glibc.

    keep_freed_memory's heap otherwise keeps every page it ever touched, and what sampling frees (the
    sampler's weights, KV cache, logits) does not fit training's allocations, which then take new pages
    beside it: resident memory creeps up step after step. train.py calls this once a step, after the
    sampler sleeps. The cost is page faults: training touches its pages afresh each step (measured in
    the README's memory breakdown), instead of only the first time.
    """
    import ctypes

    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim(0)
    return True


def has_bf16_units() -> bool:
    """bf16 pays off on GPUs and on CPUs with bf16 matrix units (AMX or AVX512-BF16)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:  # not Linux: no cheap way to tell, and float32 is never wrong
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
