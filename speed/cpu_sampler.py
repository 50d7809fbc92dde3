"""SPEED: the HF sampler's CPU fast path (bucketed KV cache, grouped attention, oneDNN-packed bf16 linears, two-level
draw): HFSampler(fast=True)._decode uses it, finished rows leaving; the plain version is HFSampler(fast=False).

    python -m pytest tests/test_rollout.py -k "cpu_fast_path or grouped or packed or blocked or finished"
"""

import collections

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from plumbing.models import check_finite


# SPEED TRICK: tests/test_rollout.py::test_cpu_fast_path_samples_what_the_plain_loop_samples (the whole path against
# HFSampler(fast=False)); each piece below names its own test.
class FastPath:
    """HFSampler's CPU fast path: grouped attention, and its packed weights."""

    def __init__(self, model):
        if model.config._attn_implementation == "eager":  # another implementation was asked for by name: keep it
            model.set_attn_implementation("grouped_eager")
        self.packed = (
            model.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
        # {weight name: layer}; without oneDNN's bf16 kernels (AVX2-only CPUs) the layers stay plain
        self.packed_only = _pack_linears(model) if self.packed else {}

    def load(self, name, tensor) -> bool:
        """Pack a weight kept only packed straight from the new tensor; False for any other weight."""
        layer = self.packed_only.get(name)
        if layer is not None:
            layer.packed_weight = _pack(tensor.to(layer.weight.device, layer.weight.dtype))
        return layer is not None

    def repack(self, model):
        """After a sync, pack the linear weights kept plain too (a tied lm_head's)."""
        if self.packed:
            for layer in model.modules():
                if isinstance(layer, torch.nn.Linear) and layer not in self.packed_only.values():
                    layer.packed_weight = _pack(layer.weight)

    def sleep(self, model) -> int:
        """Free the packed weights too; the bytes freed."""
        layers = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
        freed = sum(m.packed_weight.numel() * m.packed_weight.element_size() for m in layers)
        for layer in layers:
            layer.packed_weight = None
        return freed


# SPEED TRICK: tests/test_rollout.py::test_grouped_attention_matches_eager (against DynamicCache): DynamicCache
# concatenates at every step, and each new key length makes oneDNN build and keep a new kernel
class BucketedLayer(DynamicLayer):
    """One layer's KV cache in a buffer a multiple of `bucket` long, written in place: few oneDNN shapes, no copies."""

    is_croppable = False  # crop would cut the buffer's empty end

    def __init__(self, bucket=64):
        super().__init__()
        self.bucket = bucket
        self.length = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:  # its empty buffers, shaped as the states: the first call grows them
            self.lazy_initialization(key_states, value_states)
            self.keys = key_states[:, :, :0]
            self.values = value_states[:, :, :0]
        start = self.length
        self.length += key_states.shape[-2]
        if self.length > self.keys.shape[-2]:  # a new buffer, the next multiple of `bucket` long
            # zeros: the masked slots past the cached tokens meet the softmax's 0 weight, and 0 x NaN would be NaN
            grow = (0, 0, 0, -self.length % self.bucket)
            self.keys = F.pad(torch.cat([self.keys[:, :, :start], key_states], -2), grow)
            self.values = F.pad(torch.cat([self.values[:, :, :start], value_states], -2), grow)
        else:
            self.keys[:, :, start : self.length] = key_states
            self.values[:, :, start : self.length] = value_states
        return self.keys, self.values

    def get_seq_length(self):
        return self.length

    def get_mask_sizes(self, query_length):  # asked before update
        end = self.length + query_length
        return end + -end % self.bucket, 0  # update's buffer length: the next multiple of `bucket`


# SPEED TRICK: tests/test_rollout.py::test_grouped_attention_matches_eager: repeat_kv copies every cached key and
# value once per query head of its group, at every decode step
def _grouped_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention without `repeat_kv`'s copies: a group's query heads are rows of one matmul."""
    batch, heads, length, dim = query.shape
    groups = key.shape[1]  # key/value heads
    query = query.reshape(batch, groups, heads // groups * length, dim)  # (B, KV, G * Q, D), a view
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = (scores.unflatten(2, (heads // groups, length)) + attention_mask[:, :, None]).flatten(2, 3)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None  # (B, Q, H, D)


AttentionInterface.register("grouped_eager", _grouped_eager_attention)
AttentionMaskInterface.register("grouped_eager", eager_mask)


# SPEED TRICK: tests/test_rollout.py::test_packed_bf16_linears_compute_the_plain_linears (bit for bit): a plain bf16
# linear reorders its weight for oneDNN at every call
def _pack_linears(model) -> dict:
    """Run every linear from a oneDNN-packed bf16 weight, freeing unshared plain ones; {weight name: layer} of those."""
    embedding = model.get_input_embeddings().weight
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    users = collections.Counter(id(m.weight) for _, m in linears)  # a shared weight stays plain too
    packed_only = {}
    for name, module in linears:
        module.packed_weight = _pack(module.weight)
        module.forward = _packed_linear_forward.__get__(module)
        if module.weight is not embedding and users[id(module.weight)] == 1:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
            packed_only[f"{name}.weight"] = module
    return packed_only


def _pack(weight):
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def _packed_linear_forward(self, x):
    return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


# SPEED TRICK: tests/test_rollout.py::test_blocked_draw_equals_the_full_cdf (against rollout.draw): the plain draw's
# float64 cumsum runs over the whole vocabulary for every row and every token
def draw(probs, uniforms, block=256):
    """rollout.draw in two levels: the block, then the token inside it (a V / block + block scan, not V)."""
    pad = -probs.shape[-1] % block
    if pad:  # zeros up to a whole block
        probs = F.pad(probs, (0, pad))
    by_block = probs.view(len(probs), -1, block)  # (R, B, b)
    cdf = by_block.sum(-1, dtype=torch.float64).cumsum(-1)  # (R, B); float64 keeps every token's share
    total = cdf[:, -1:]
    check_finite(total)  # a NaN, inf or all-zero row would draw an arbitrary token
    below = torch.zeros_like(total)
    # below the total: u * total can round up to it, and searchsorted would step past the last block
    u = torch.minimum(uniforms.to(torch.float64).reshape(-1, 1) * total, torch.nextafter(total, below))
    chosen = torch.searchsorted(cdf, u, right=True)  # first block whose CDF exceeds u
    u = u - F.pad(cdf, (1, 0)).gather(-1, chosen)  # the mass of the blocks before it
    in_block = by_block.gather(1, chosen[:, :, None].expand(-1, -1, block)).squeeze(1)  # (R, b)
    inside = in_block.double().cumsum(-1)
    u = torch.minimum(u, torch.nextafter(inside[:, -1:], below))  # the block's scan can end an ulp above its sum
    return (chosen * block + torch.searchsorted(inside, u, right=True)).squeeze(-1)
