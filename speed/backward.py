"""What backward keeps from forward, made smaller: the policy's and the frozen reference's memory tricks.

The plain version is bf16 autocast over float32 weights with nothing changed: each linear layer keeps its bf16
weight cast for backward, each norm and MLP gate keeps its intermediates, and the reference is stored in
float32. Each trick below computes the same bits as that plain version; the test named in its banner holds it.
`configure_backward` is the one line train.py calls (train.load_models), before FSDP2 wraps the layers.

    python -m pytest tests/test_train.py -k "bf16 or cast or recompute"
"""

import itertools
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from plumbing.models import enable_grad_checkpointing
from speed.compile import compile_layers


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
    backward, every micro-batch (one process; under bf16 FSDP2 the gathered weights are bf16 already and this
    trick does nothing). Recasting in backward costs one more
    cast per layer and changes no number: the forward and the gradients (bias included) are bit-identical to autocast's
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
    bf16). Rerunning them (torch.utils.checkpoint on these few ops, not on the layer) keeps a share of the
    activations off the peak (tools/memory_plan.py counts what stays) and changes no number: the
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
