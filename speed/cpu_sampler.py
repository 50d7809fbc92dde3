"""The HF sampler's fast path on CPU: rollout.HFSampler's plain decode loop, made fast for CPU kernels.

rollout.py holds the plain version (`HFSampler._decode`, `draw`, nn.Linear layers, transformers' DynamicCache
and eager attention) and turns this one on where the model sits on CPU (`HFSampler.__init__`). Both sample the
same tokens with the same log-probs: tests/test_rollout.py::test_cpu_fast_path_samples_what_the_plain_loop_samples.
What it changes, each held by its own test in tests/test_rollout.py:
1. A KV cache that grows in buckets and is written in place (`BucketedLayer`; test_grouped_attention_matches_eager).
2. Grouped-query attention without repeat_kv's copies (`_grouped_eager_attention`; the same test).
3. bfloat16 linear layers computed from oneDNN-packed weights (`_pack_linears`;
   test_packed_bf16_linears_compute_the_plain_linears).
4. The inverse-CDF draw in two levels, blocks then tokens (`draw`; test_blocked_draw_equals_the_full_cdf).
5. Finished rows leave the decode batch (`FastPath.decode`;
   test_finished_rows_leave_the_batch_without_changing_samples).
"""

import collections
import types

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from plumbing.models import check_finite


class FastPath:
    """What HFSampler does differently on CPU: its decode loop, and where its linear weights live."""

    def __init__(self, model):
        if model.config._attn_implementation == "eager":  # CPU (plumbing.models.load_model)
            model.set_attn_implementation("grouped_eager")
        self.packed = model.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() \
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        self.packed_only = _pack_linears(model) if self.packed else {}  # {weight name: its linear layer}

    def decode(self, model, input_ids, mask, positions, generators, *, n, max_tokens, pad_id, eos, choose):
        """rollout.HFSampler._decode with a bucketed cache and finished rows leaving the batch."""
        device = input_ids.device
        # The index tensor instead of logits_to_keep=1: the strided last-position slice sends a bf16 lm_head
        # down a slow matmul path that copies the weight per row (pytorch#151934).
        cache = Cache(layers=[BucketedLayer() for _ in range(model.config.num_hidden_layers)])
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=torch.tensor([input_ids.shape[1] - 1], device=device))
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # (R, V), R = G * n
        mask, positions = mask.repeat_interleave(n, 0), positions.repeat_interleave(n, 0)[:, -1:]  # (R, P), (R, 1)
        tokens = torch.full((len(logits), max_tokens), pad_id, device=device)  # (R, K)
        logps = torch.zeros(len(logits), max_tokens, device=device)  # (R, K)
        rows = torch.arange(len(logits), device=device)  # (A,): the output row of each batch row, A <= R
        live = torch.ones(len(logits), dtype=torch.bool, device=device)  # (A,): not finished yet
        for i in range(max_tokens):
            token, logp = choose(logits, generators)  # (A,), (A,)
            tokens[rows[live], i], logps[rows[live], i] = token[live], logp[live]
            token = torch.where(live, token, pad_id)  # finished rows still in the batch feed padding
            live &= ~torch.isin(token, eos)
            if not live.any() or i == max_tokens - 1:
                break
            # Once an eighth of the batch has drawn EOS, those rows leave it, so later steps compute only rows
            # still decoding (each leaving copies the whole cache, hence not one by one). A row keeps its own
            # generator, so its draws are the ones it makes in the full batch.
            if (~live).sum() * 8 >= len(live):
                keep = live.nonzero().squeeze(-1)  # (A',)
                cache.batch_select_indices(keep)
                rows, live, token, mask, positions = rows[keep], live[keep], token[keep], mask[keep], positions[keep]
                generators = [generators[j] for j in keep.tolist()]
            positions = positions + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, logits = out.past_key_values, out.logits[:, -1].float()  # (A, V)
        return tokens, logps

    def load(self, name, tensor) -> bool:
        """Pack a weight kept only in oneDNN's layout straight from the new tensor; False for any other weight."""
        if name not in self.packed_only:
            return False
        layer = self.packed_only[name]
        layer.packed_weight = _pack(tensor.to(layer.weight.device, layer.weight.dtype))
        return True

    def repack(self, model):
        """After a sync, pack the linear weights kept plain too (a tied lm_head: the embedding table)."""
        if self.packed:
            packed_only = set(self.packed_only.values())
            for layer in model.modules():
                if isinstance(layer, torch.nn.Linear) and layer not in packed_only:
                    layer.packed_weight = _pack(layer.weight)

    def owns(self, name) -> bool:
        """Whether the weight lives only packed (then `empty` says whether it has storage)."""
        return name in self.packed_only

    def empty(self, name) -> bool:
        return self.packed_only[name].packed_weight is None

    def sleep(self, model) -> int:
        """Free the packed weights too; the bytes freed."""
        freed = 0
        for module in model.modules():
            if getattr(module, "packed_weight", None) is not None:
                freed += module.packed_weight.numel() * module.packed_weight.element_size()
                module.packed_weight = None
        return freed


class BucketedLayer(DynamicLayer):
    """One layer's KV cache, kept in a buffer whose length is a multiple of `bucket`, written in place.
    DynamicCache concatenates every layer's whole cache on every decode step (a copy of the cache per token), and
    each step's attention matmuls have a new key length: oneDNN builds and keeps (primitive cache) a kernel per
    shape, so one or more per decode step, which stay resident through training. Here the cache grows once per `bucket`
    tokens and attention always reads the whole buffer, so a call meets a few shapes, seen again on the next call.
    The slots past the cached tokens are zeros, and the attention mask (2D mask padded to the buffer's length by
    transformers) gives them probability exactly 0."""

    is_croppable = False  # the sampler never crops; DynamicLayer's crop would cut the buffer's empty end

    def __init__(self, bucket=64):
        super().__init__()
        self.bucket, self.length = bucket, 0

    def _buffer_length(self, length):
        return -(-length // self.bucket) * self.bucket

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self.length == 0 or end > self.keys.shape[-2]:
            keys, values = (s.new_zeros(*s.shape[:2], self._buffer_length(end), s.shape[3])
                            for s in (key_states, value_states))  # zeros: 0 x (a NaN left in a slot) would be NaN
            if self.length:
                keys[:, :, :self.length] = self.keys[:, :, :self.length]
                values[:, :, :self.length] = self.values[:, :, :self.length]
            self.keys, self.values = keys, values
        self.keys[:, :, self.length:end], self.values[:, :, self.length:end] = key_states, value_states
        self.length = end
        return self.keys, self.values

    def get_seq_length(self):
        return self.length

    def crop(self, max_length):
        raise NotImplementedError("BucketedLayer keeps room past its tokens and does not crop")

    def reset(self):
        super().reset()
        self.length = 0

    def get_mask_sizes(self, query_length):  # asked before update: the buffer's length once these tokens are in
        return self._buffer_length(self.length + query_length), 0


def _grouped_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention without `repeat_kv`, which copies every cached key and value once per query
    head sharing it (grouped-query attention: SmolLM2-135M has 9 query heads on 3 key/value heads), every
    layer, every decode step. Instead the query heads of a group become rows of one matmul against their
    shared keys."""
    batch, heads, length, dim = query.shape
    groups = key.shape[1]  # key/value heads; query head h reads key/value head h // (heads // groups)
    query = query.reshape(batch, groups, heads // groups * length, dim)  # (B, KV, G * Q, D), a view
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, KV, G * Q, L)
    if attention_mask is not None:  # (B, 1, Q, L), the same for every head
        scores = (scores.unflatten(2, (heads // groups, length)) + attention_mask[:, :, None]).flatten(2, 3)
    weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value)  # (B, KV, G * Q, D)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None  # (B, Q, H, D)


AttentionInterface.register("grouped_eager", _grouped_eager_attention)
AttentionMaskInterface.register("grouped_eager", eager_mask)  # additive float masks, as eager attention takes


def _pack_linears(model) -> dict:
    """Give every linear layer its bfloat16 weight in oneDNN's blocked layout, and compute the layer from it. A
    plain bfloat16 linear on CPU re-lays-out its whole weight on every call, so a decode step's matmuls cost about
    the same at 1 row as at 64. The plain weight is then dead and freed (update_weights packs the new one
    straight in), except a tied lm_head's, which is the embedding table (or any weight two layers share).
    Returns {weight name: layer} of the layers whose weight now lives only packed."""
    embedding = model.get_input_embeddings().weight
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    users = collections.Counter(id(m.weight) for _, m in linears)  # a weight two layers share stays plain too
    packed_only = {}
    for name, module in linears:
        module.packed_weight = _pack(module.weight)
        module.forward = types.MethodType(_packed_linear_forward, module)
        if module.weight is not embedding and users[id(module.weight)] == 1:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
            packed_only[f"{name}.weight"] = module
    return packed_only


def _pack(weight):
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def _packed_linear_forward(self, x):
    return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def draw(probs, uniforms, block=256):
    """One token per row of `probs` (R, V), non-negative and unnormalised, by inverting each row's CDF at
    its uniform in [0, 1) from `uniforms` (R,). torch.multinomial draws an exponential variate for every
    vocabulary entry instead, the largest non-matmul cost of a decode step. The CDF is inverted in two
    levels: over block sums to find the token's block, then within that block alone, so the sequential
    float64 scan covers V / block + block entries instead of V. Zero-probability tokens (cut by top-p) are
    never drawn: the CDF does not rise at them and u stays strictly below the top of each level.
    """
    rows, vocab = probs.shape
    blocks = -(-vocab // block)
    if blocks * block != vocab:  # zeros at the end: never drawn
        probs = torch.nn.functional.pad(probs, (0, blocks * block - vocab))
    by_block = probs.view(rows, blocks, block)  # (R, B, b)
    cdf = by_block.sum(-1, dtype=torch.float64).cumsum(-1)  # (R, B); float64 keeps every token's share
    total = cdf[:, -1:]  # (R, 1)
    check_finite(total)  # a NaN or inf anywhere in a row reaches its total
    below = torch.zeros_like(total)  # (R, 1)
    u = uniforms.to(torch.float64).reshape(-1, 1) * total  # (R, 1)
    u = torch.minimum(u, torch.nextafter(total, below))  # (R, 1), < total
    chosen = torch.searchsorted(cdf, u, right=True)  # (R, 1): first block whose CDF exceeds u, so its mass > 0
    u = u - torch.where(chosen > 0, cdf.gather(-1, (chosen - 1).clamp(min=0)), below)  # (R, 1), >= 0
    inside = by_block.gather(1, chosen[:, :, None].expand(-1, -1, block)).squeeze(1).double().cumsum(-1)  # (R, b)
    # The block's own scan can end an ulp away from its sum above; u stays below the scan's top.
    u = torch.minimum(u, torch.nextafter(inside[:, -1:], below))  # (R, 1)
    return (chosen * block + torch.searchsorted(inside, u, right=True)).squeeze(-1)  # (R,)
