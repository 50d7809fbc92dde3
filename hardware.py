"""The machine at hand: the attention kernel, bf16 units, what backward keeps and the CPU allocator.

Apart from has_bf16_units, which picks bf16 autocast for `train.py --dtype auto`, nothing here changes a
number the algorithm computes: each choice is held equal to the plain version by a test (named in the
SPEED TRICK or MEMORY TRICK line above it), and the README's "Measured" section says what each bought.
A model that cannot be loaded raises ModelLoadError, one line naming the model, --model and HF_HUB_OFFLINE.

    python -m pytest tests/test_loss.py tests/test_train.py -k "eager or bf16 or freed_memory or cast or recompute"
"""

import itertools
import os
import weakref

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


# ---- MEMORY TRICK (skippable): recast weights in backward, one input cast shared; tests/test_train.py::
# test_recast_linears_*, test_backward_keeps_one_cast_per_input_and_reruns_down_projs_input
_last_cast = (None, 0, None)  # (weakref to a linear's input, its version, weakref to its bf16 cast)


def _bf16_input(x):
    """x.to(bfloat16), reused while the next layer reads the very same x (q/k/v, gate/up).

    Autocast casts a layer's input at every call, so q, k and v each keep their own bf16 copy of the
    same normalised hidden states for backward, and gate and up two more: one shared copy per input
    instead (weak references: the cache keeps nothing alive; the version counter sees an in-place write).
    """
    global _last_cast
    source, version, cast = _last_cast
    x16 = cast() if source is not None and source() is x and version == x._version else None
    if x16 is None:
        x16 = x.to(torch.bfloat16)
        _last_cast = (weakref.ref(x), x._version, weakref.ref(x16))
    return x16


class _LinearRecastInBackward(torch.autograd.Function):
    """F.linear under bf16 autocast, saving the float32 weight instead of its bf16 cast.

    The same matmuls as autocast's F.linear and its backward, so the same bits; the backward casts the
    weight again (a cheap elementwise pass) rather than keeping the cast alive from forward to backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        x16 = _bf16_input(x)  # what autocast does to every operand, once for the layers that share x
        ctx.save_for_backward(x16, weight)  # weight: the parameter itself, no new memory
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        w16 = weight.to(torch.bfloat16)
        if bias is None:
            return torch.matmul(x16, w16.t())
        return torch.nn.functional.linear(x16, w16, bias.to(torch.bfloat16))  # addmm on the (N, in) view

    @staticmethod
    def backward(ctx, grad):
        x16, weight = ctx.saved_tensors
        grad_x, grad_w = _recast_linear_grads(grad, x16, weight, ctx.x_dtype, *ctx.needs_input_grad[:2])
        # addmm's bias gradient: the rows summed, then cast to the bias's float32
        need_b = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype) if need_b else None
        return grad_x, grad_w, grad_b


def _recast_linear_grads(grad, x16, weight, x_dtype, need_x: bool, need_w: bool):
    """The calls autograd makes in the backward of mm(x16, w16.t()) (or addmm), with w16 the float32 weight cast
    again: grad_x = g @ w16, cast to x's dtype; grad_w = g^T @ x16, cast to the weight's float32."""
    w16, g = weight.to(torch.bfloat16), grad.reshape(-1, grad.shape[-1])  # (N, out)
    grad_x = g.mm(w16).view(*grad.shape[:-1], w16.shape[1]).to(x_dtype) if need_x else None
    grad_w = g.t().mm(x16.reshape(-1, x16.shape[-1])).to(weight.dtype) if need_w else None
    return grad_x, grad_w


def _recasts(layer, x) -> bool:
    """Whether `layer` (an nn.Linear) takes the recast path for input x: a float32 weight that trains, under
    bf16 autocast with grad on (elsewhere the plain forward is already what autograd keeps)."""
    return (getattr(layer, "recasts_in_backward", False)
            and layer.weight.dtype == torch.float32 and torch.is_grad_enabled() and layer.weight.requires_grad
            and torch.is_autocast_enabled(x.device.type)
            and torch.get_autocast_dtype(x.device.type) == torch.bfloat16)


def _linear_forward(self, x):
    if _recasts(self, x):
        return _LinearRecastInBackward.apply(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def recast_linears_in_backward(model):
    """Make the model's nn.Linear layers keep their float32 weight, not a bf16 copy, for backward.

    Under bf16 autocast each linear layer's forward casts its float32 weight to bf16 and autograd keeps
    that copy until the layer's backward: 2 bytes per parameter for the whole model from forward to
    backward, every micro-batch (0.27 GB for SmolLM2-135M; 2.9 GiB per rank for Qwen2.5-1.5B under FSDP2,
    where the gathered weights are cast). Recasting in backward costs one more cast per layer and changes
    no number: the forward and the gradients (bias included) are bit-identical to autocast's
    (tests/test_train.py::test_recast_linears_in_backward_is_bit_identical). Layers reading the same input
    share its bf16 cast (_bf16_input). Elsewhere (float32, no grad) the layer runs its plain forward.
    In place; returns the model.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = _linear_forward.__get__(module)
            module.recasts_in_backward = True
    return model


# ---- MEMORY TRICK (skippable): recompute norms and the gate (and down_proj's input) in backward;
# tests/test_train.py::test_recompute_*, test_backward_keeps_one_cast_per_input_and_reruns_down_projs_input
def _gate(act_fn, gate, up):
    return act_fn(gate) * up


class _GatedDownRecast(torch.autograd.Function):
    """down_proj(act_fn(gate) * up) under bf16 autocast, where down_proj recasts in backward: keeps gate,
    up and down_proj's float32 weight, not act_fn(gate) * up (down_proj's input), which backward reruns.

    Checkpointing the gate alone still leaves its output saved, by down_proj. The ops are those of the
    gate's rerun and of _LinearRecastInBackward, in the same order on the same inputs: the same bits.
    """

    @staticmethod
    def forward(ctx, gate, up, weight, act_fn):
        ctx.save_for_backward(gate, up, weight)
        ctx.act_fn, ctx.device = act_fn, gate.device.type
        h16 = _gate(act_fn, gate, up).to(torch.bfloat16)  # (.., intermediate): bf16 already, as gate and up are
        return torch.matmul(h16, weight.to(torch.bfloat16).t())

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        with torch.enable_grad(), torch.autocast(ctx.device, dtype=torch.bfloat16):  # the forward's context
            gate, up = gate.detach().requires_grad_(ctx.needs_input_grad[0]), up.detach().requires_grad_(
                ctx.needs_input_grad[1])
            h = _gate(ctx.act_fn, gate, up)
        need_h = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        h16 = h.detach().to(torch.bfloat16)  # down_proj's input, as _LinearRecastInBackward saved it
        grad_h, grad_w = _recast_linear_grads(grad, h16, weight, h.dtype, need_h, ctx.needs_input_grad[2])
        grad_gate = grad_up = None
        if need_h:
            wanted = [t for t in (gate, up) if t.requires_grad]
            grads = iter(torch.autograd.grad(h, wanted, grad_h))
            grad_gate = next(grads) if gate.requires_grad else None
            grad_up = next(grads) if up.requires_grad else None
        return grad_gate, grad_up, grad_w, None


def _gated_mlp_forward(self, x):  # LlamaMLP / Qwen2MLP.forward, with the elementwise gate recomputed
    gate_up = (self.act_fn, self.gate_proj(x), self.up_proj(x))
    if not torch.is_grad_enabled():
        return self.down_proj(_gate(*gate_up))
    if _recasts(self.down_proj, x) and self.down_proj.bias is None:  # and down_proj's input rerun with it
        return _GatedDownRecast.apply(gate_up[1], gate_up[2], self.down_proj.weight, self.act_fn)
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
    test_recompute_norms_and_gates_is_bit_identical). Where down_proj also recasts in backward (bf16 autocast,
    recast_linears_in_backward), down_proj's input act_fn(gate) * up is rerun too (_GatedDownRecast). For a
    policy without enable_grad_checkpointing, which already reruns whole layers. In place; returns the model.
    """
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _recomputed_norm_forward.__get__(module)
        elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            module.forward = _gated_mlp_forward.__get__(module)
    return model


def configure_backward(model, *, bf16: bool, checkpointing: bool, compiled: bool = False):
    """What the policy keeps for backward, as train.load_models sets it up (before FSDP2 wraps the layers):
    whole layers rerun with `checkpointing`, else the norms and MLP gates; under bf16 autocast, linear
    weights recast in backward. With `compiled` (train.py --compile) the layers are compiled instead of
    given the eager tricks: torch.compile's partitioner picks what backward keeps and recomputes the
    elementwise ops itself, and the tricks' autograd Functions would only break its graph.
    The benches and tests that measure train.py's backward call this too."""
    if checkpointing:
        enable_grad_checkpointing(model)
    if compiled:
        return compile_layers(model)
    if not checkpointing:
        recompute_norms_and_gates_in_backward(model)
    if bf16:
        recast_linears_in_backward(model)
    return model


# ---- SPEED TRICK (skippable, off by default: train.py --compile); tests/test_grad_checkpointing.py::
# test_compiled_layers_keep_loss_and_gradients_*, tests/test_train.py::test_compiled_bf16_*
def compile_layers(model):
    """torch.compile each decoder layer, with dynamic shapes, in place; returns the model.

    Per layer, not the whole model: every layer runs the same code, so one graph serves all of them (one more
    each for the no-grad forwards of the reference and of the sync probe): about 30 s of compiling on two CPU
    cores from a cold cache, where the whole model as one graph took minutes (tried once). torch keeps the
    kernels in /tmp/torchinductor_$USER, or $TORCHINDUCTOR_CACHE_DIR, for the next run. Dynamic shapes: each
    step's sequence lengths differ, and one graph takes them all. The layer is also FSDP2's unit (train.shard),
    so its hooks stay outside the graph; nn.Module.compile keeps the parameter names, so checkpoints and the
    weight sync see the same model.

    Not bit-identical: the compiled kernels fuse elementwise ops and round in other places. In float32 it
    equals the eager layers to float rounding; under bf16 autocast its update is as far from the float32
    update as the eager layers' is (the tests named above). On CPU it needs a C++ compiler.
    """
    for layer in model.model.layers:
        layer.compile(dynamic=True)
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
