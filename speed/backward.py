"""Memory tricks shrinking what backward keeps; the plain version is bf16 autocast over float32 weights.

python -m pytest tests/test_train.py -k "bf16 or cast or recompute"
"""

import itertools
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from plumbing.models import enable_grad_checkpointing
from speed.compile import compile_layers


# MEMORY TRICK: tests/test_train.py::test_bf16_reference_is_exact: a frozen reference under bf16 autocast casts each
# linear's weight to bf16 anyway, so storing it in bf16 halves its memory and changes no output
def store_linears_bf16(model):
    """Store a frozen model's untied nn.Linear weights in bfloat16, in place."""
    embedding = model.get_input_embeddings().weight
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not embedding:
            module.to(torch.bfloat16)  # autocast casts it to bf16 anyway
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.dtype != torch.bfloat16:  # off from_pretrained's file mapping
            tensor.data = tensor.data.clone()
    return model


# MEMORY TRICK: tests/test_train.py::test_recast_linears_in_backward_is_bit_identical: autocast saves each linear's
# bf16 weight copy for backward, a second copy of the model; recasting the float32 weight there is bitwise the same
_last_cast = (None, 0, None)  # (input ref, its version, cast ref)


def _bf16_input(x):
    """x.to(bfloat16), one cast shared by the layers that read the same x (q/k/v, gate/up)."""
    global _last_cast
    source, version, cast = _last_cast
    # the same tensor, unchanged since (its version): q/k/v read one x, so one cast serves all three
    x16 = cast() if source is not None and source() is x and version == x._version else None
    if x16 is None:
        x16 = x.to(torch.bfloat16)
        _last_cast = (weakref.ref(x), x._version, weakref.ref(x16))
    return x16


class _LinearRecastInBackward(torch.autograd.Function):
    """F.linear under bf16 autocast, saving the float32 weight, not its bf16 cast."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x16 = _bf16_input(x)
        ctx.save_for_backward(x16, weight)  # the parameter itself, no new memory
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return torch.nn.functional.linear(x16, weight.to(torch.bfloat16), None if bias is None else bias.to(x16.dtype))

    @staticmethod
    def backward(ctx, grad):
        x16, weight = ctx.saved_tensors
        grad_x, grad_w = _recast_linear_grads(grad, x16, weight, ctx.x_dtype, *ctx.needs_input_grad[:2])
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def _recast_linear_grads(grad, x16, weight, x_dtype, need_x: bool, need_w: bool):
    """Backward of mm(x16, w16.t()): g @ w16, g^T @ x16."""
    w16 = weight.to(torch.bfloat16)
    g = grad.reshape(-1, grad.shape[-1])  # (N, out)
    grad_x = g.mm(w16).view(*grad.shape[:-1], w16.shape[1]).to(x_dtype) if need_x else None
    grad_w = g.t().mm(x16.reshape(-1, x16.shape[-1])).to(weight.dtype) if need_w else None
    return grad_x, grad_w


def _recasts(layer, x) -> bool:
    """A float32 trained weight under bf16 autocast with grad."""
    return (
        getattr(layer, "recasts_in_backward", False)
        and layer.weight.dtype == torch.float32
        and torch.is_grad_enabled()
        and layer.weight.requires_grad
        and torch.is_autocast_enabled(x.device.type)
        and torch.get_autocast_dtype(x.device.type) == torch.bfloat16
    )


def _linear_forward(self, x):
    if _recasts(self, x):
        return _LinearRecastInBackward.apply(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def recast_linears_in_backward(model):
    """Make each nn.Linear save its float32 weight for backward, not a bf16 copy, in place."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = _linear_forward.__get__(module)
            module.recasts_in_backward = True
    return model


# MEMORY TRICK: tests/test_train.py::test_recompute_norms_and_gates_is_bit_identical: the norms' and the MLP gate's
# float32 activations are the largest that backward keeps, and cheap to recompute
def _gate(act_fn, gate, up):
    return act_fn(gate) * up


class _GatedDownRecast(torch.autograd.Function):
    """down_proj(act_fn(gate) * up); backward reruns down_proj's input."""

    @staticmethod
    def forward(ctx, gate, up, weight, act_fn):
        ctx.save_for_backward(gate, up, weight)
        ctx.act_fn = act_fn
        ctx.device = gate.device.type
        h16 = _gate(act_fn, gate, up).to(torch.bfloat16)
        return torch.matmul(h16, weight.to(torch.bfloat16).t())

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        with torch.enable_grad(), torch.autocast(ctx.device, dtype=torch.bfloat16):
            gate = gate.detach().requires_grad_(ctx.needs_input_grad[0])
            up = up.detach().requires_grad_(ctx.needs_input_grad[1])
            h = _gate(ctx.act_fn, gate, up)
        wanted = [t for t in (gate, up) if t.requires_grad]
        h16 = h.detach().to(torch.bfloat16)
        grad_h, grad_w = _recast_linear_grads(grad, h16, weight, h.dtype, bool(wanted), ctx.needs_input_grad[2])
        grads = iter(torch.autograd.grad(h, wanted, grad_h) if wanted else ())
        grad_gate = next(grads) if gate.requires_grad else None
        grad_up = next(grads) if up.requires_grad else None
        return grad_gate, grad_up, grad_w, None


def _gated_mlp_forward(self, x):
    gate_up = (self.act_fn, self.gate_proj(x), self.up_proj(x))
    if not torch.is_grad_enabled():
        return self.down_proj(_gate(*gate_up))
    if _recasts(self.down_proj, x) and self.down_proj.bias is None:
        return _GatedDownRecast.apply(gate_up[1], gate_up[2], self.down_proj.weight, self.act_fn)
    return self.down_proj(checkpoint(_gate, *gate_up, use_reentrant=False, preserve_rng_state=False))


def _recomputed_norm_forward(self, x):
    if not torch.is_grad_enabled():
        return type(self).forward(self, x)
    return checkpoint(type(self).forward, self, x, use_reentrant=False, preserve_rng_state=False)


def recompute_norms_and_gates_in_backward(model):
    """Rerun each RMSNorm and MLP gate in backward, in place."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _recomputed_norm_forward.__get__(module)
        elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            module.forward = _gated_mlp_forward.__get__(module)
    return model


def configure_backward(model, *, bf16: bool, checkpointing: bool, compiled: bool = False):
    """What the policy keeps for backward; compiled layers get no tricks (they would break torch.compile's graph)."""
    if checkpointing:
        enable_grad_checkpointing(model)
    if compiled:
        return compile_layers(model)
    if not checkpointing:
        recompute_norms_and_gates_in_backward(model)
    if bf16:
        recast_linears_in_backward(model)
    return model
