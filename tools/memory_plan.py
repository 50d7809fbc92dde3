"""One rank's GPU memory at the peak of a train.py run, by arithmetic on the model's shape (no weights loaded).

    python -m tools.memory_plan --task deepmath --gpus 16 --gpu-gb 80            # Table B.1's DeepMath preset on A100s
    python -m tools.memory_plan --task meetingbank --gpus 16 --gpu-gb 139 --no-grad-checkpointing
    python -m tools.memory_plan --task arith --gpus 1 --gpu-gb 24 --prompt-tokens 40   # any preset of train.py
    python -m tools.memory_plan --table                     # every paper preset on its paper GPUs (docs/memory_plan.md)

A step has three phases, and the plan adds up what one rank holds in each (GiB = 2^30 bytes):
- rollout: vLLM awake (its `gpu_memory_utilization` share: weights, KV cache, activations) beside the
  trainer's resident state: FSDP2 shards of the float32 parameters, the AdamW moments and the reference;
  with --sampler hf, the HF sampler's own copy of the weights in the run's dtype and its sampling memory for
  the rank's samples of a step (rollout.py: sampling_bytes) instead, and no share to hold the engine;
- train: vLLM asleep (level 2: KV cache and weights dropped, the sync brings the weights back), gradients,
  FSDP2's gathered layers, and one micro-batch's activations and log-prob work (the largest micro-batch:
  longest prompt + longest completion, `--micro-batch` sequences);
- optimizer: the AdamW step after the last micro-batch: the gradients reduce-scattered to shards, and under
  FSDP2 foreach AdamW's float32 temporary of one shard (its sqrt of the second moment); fused AdamW in one process
  has none. train.py measures it inside the train phase (plumbing/run_log.py: Phases);
- sync: vLLM's weights woken alone while `full_weights` streams one full parameter at a time, in the engine's
  dtype, into
  their reload; the KV cache wakes after it (rollout.py: VLLMSampler.update_weights), which is the
  rollout phase again.
A fixed CUDA_OVERHEAD covers the CUDA context, NCCL and cuBLAS workspaces and allocator slack; torch's allocator
counts none of it, so `trainer_allocated` (what scripts/gpu_check.sh holds against torch's measured peaks) leaves it
out, with vLLM's rows. Each row says what backs it: `calibration` (none has been calibrated on a GPU yet).
A share too small for the engine's weights and one full-length sequence's KV cache, which vLLM refuses at start-up,
does not fit whatever the peak (engine_share_error; train.py checks the same before it builds the engine).

What train.py does that sets these numbers (read from its code, not guessed):
1. Master weights, gradients and AdamW's two moments are float32: 4 + 4 + 8 bytes per parameter, divided
   by the ranks under FSDP2 (`fully_shard`). But FSDP2 keeps *unsharded* gradients while
   `set_requires_gradient_sync(False)` skips the reduce-scatter, which train.ppo_update does on every
   micro-batch but the last of a minibatch: with two or more micro-batches per rank, each rank holds the
   whole model's float32 gradient (4 bytes per parameter, not divided).
2. The reference is float32 and sharded under FSDP2, which train.py uses under torchrun at any size, one rank
   included (train.load_reference keeps bf16 linears only in one process, where store_linears_bf16 applies).
   FSDP2 leaves a root module's parameters gathered after its forward, so the reference's root (the embedding
   and final norm, bf16) stays gathered from its first forward on, and the policy's from each no-grad forward
   (the sync probe's) to its next backward.
3. Under FSDP2 with bf16, mixed precision (plumbing/parallel.shard): each layer is gathered in bf16, 2 bytes per
   parameter. In one process, bf16 autocast over float32 weights, with the policy's linear layers recasting their
   weight in backward (speed/backward.py: recast_linears_in_backward): no bf16 copy of a weight lives from
   forward to backward, only the one weight a layer is casting at that moment (the lm_head, or an h x f matrix).
4. The residual stream stays float32 (float32 embedding + bf16 branch outputs), RMSNorm computes in float32.
5. Logits exist only for the K + 1 completion positions (`logits_to_keep`); the chunked log-prob kernel saves them
   and, in backward, writes a gradient of the same size, which slicing off the last position copies once
   more: two logits-sized tensors at once, plus its float32 row chunks (speed.logprobs.CHUNK_ELEMENTS).

Activations saved per token per decoder layer (h hidden, f intermediate, q = heads x head_dim, qr = q when
keys and values are repeated for grouped-query attention, c = 2 bytes under bf16 autocast, 4 in float32):
    RMSNorm x2: input 4h + normalised 4h                                 16h  (8h: normalised output rerun)
    linear inputs: q/k/v and gate/up each cast their input to bf16     5ch  (float32: the 2 norm outputs, 8h)
    attention: rotated q, repeated k and v, o_proj input             c(2q + 2qr)
      eager (CPU): softmax probabilities, float32 + bf16 copy            (4 + c) x heads x S   (c = 4: 4 x heads x S)
      SDPA (GPU, memory-efficient): output + logsumexp, no probabilities cq + 4 x heads
    MLP: gate, silu(gate), up, silu(gate) * up                           4cf  (3cf: silu(gate) rerun)
plus, once for all layers, RoPE's cos/sin (8 x head_dim per token) and, for SDPA, the (B, 1, S, S) padding
mask. A layer's backward adds its largest gradient: eager's float32 gradient of the probabilities
(4 x heads x S per token), SDPA's dq, dk, dv. With gradient checkpointing (enable_grad_checkpointing)
only each layer's float32 input (4h per token) is kept, and backward recomputes one layer at a time.
bench/plan_check.py measures these formulas against CPU peaks.

With --lora-rank r (peft's adapters on --lora-targets) the float32 base stays whole and frozen: gradients, AdamW's
moments and its temporary are the adapters' (r x (in + out) per adapted linear), the reference is the base itself
(no second model), and the embedding and lm_head, frozen, make no weight gradient. In one process under bf16 each
frozen linear's bf16 cast lives from forward to backward (autocast caches no cast of a frozen weight, and
speed/backward.py recasts only trained ones): at most 2 bytes per decoder weight, a row of its own. The adapters' own
activations (r numbers per token and adapted linear) are left out.
"""

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from types import SimpleNamespace

from speed.logprobs import CHUNK_ELEMENTS
from tasks import TASKS

GiB = 2**30
CUDA_OVERHEAD = 2.0 * GiB  # CUDA context, NCCL communicators, cuBLAS workspaces, allocator slack: not yet measured
VLLM_ASLEEP = 1.0 * GiB  # what a level-2 sleeping vLLM keeps (its CUDA graphs' pool): not yet measured
# plumbing/parallel.py: shard() reshards the root after forward too, so no root stays gathered after a forward
# (FSDP2's default keeps it, for the backward that usually follows). False would count them.
ROOT_RESHARDED_AFTER_FORWARD = True

# What backs each row. No row has been calibrated on a GPU yet: every GPU figure is an estimate until
# scripts/gpu_check.sh has run on one; a row its run calibrates moves to GPU_CALIBRATED, naming the run in
# docs/gpu.md. CPU_CHECKED rows were measured against CPU peaks in one process (bench/plan_check.py,
# docs/memory_plan.md); on a GPU they are estimates too. ESTIMATED rows are arithmetic or assumed constants.
GPU_CALIBRATED: dict[str, str] = {}  # row -> the docs/gpu.md run that calibrated it
CPU_CHECKED = frozenset(
    {
        "params",
        "adamw",
        "grads",
        "activations",
        "bf16 weight cast",
        "layer backward",
        "final norm",
        "logits + chunks",
        "lm_head gradient",
    }
)
ESTIMATED = frozenset(
    {
        "reference",
        "fsdp2 roots gathered",
        "cuda overhead",
        "vllm awake",
        "hf sampler awake",
        "vllm asleep",
        "lora frozen casts",
        "fsdp2 gathered",
        "adamw temporary",
        "vllm weights",
        "one full parameter",
    }
)
# the sampler's, not the trainer's: plumbing/run_log.py's Phases subtracts what the sampler holds once built (the HF
# sampler's sampling memory still lands in torch's rollout peak, which no gate of scripts/gpu_check.sh reads)
ENGINE_ROWS = frozenset({"vllm awake", "hf sampler awake", "vllm asleep", "vllm weights"})
OUTSIDE_ALLOCATOR = frozenset({"cuda overhead"})  # device memory torch's allocator never counts

# Tables B.1 and B.2: GPUs per run. GiB as the cards report it: A100 80 GB has 80 GiB; the H200 this
# project is lent reports about 139 GiB.
PAPER_HARDWARE = {
    "gsm8k": (8, "A100", 80),
    "countdown": (8, "H200", 139),
    "deepmath": (16, "H200", 139),
    "poetry": (8, "A100", 80),
    "meetingbank": (16, "H200", 139),
    "openthoughts": (16, "H200", 139),
}


@dataclass(frozen=True)
class Shape:
    """A Llama/Qwen2 decoder: what memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int
    tied: bool = True
    qkv_bias: bool = False

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden + (q + 2 * kv) * self.qkv_bias
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # + MLP + 2 RMSNorms

    def lora_params(self, rank: int, targets: str) -> int:
        """Parameters of rank-`rank` adapters on the comma list `targets` of each decoder layer's linears."""
        q, kv, h, f = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        sizes = {
            "q_proj": h + q,
            "k_proj": h + kv,
            "v_proj": h + kv,
            "o_proj": q + h,
            "gate_proj": h + f,
            "up_proj": h + f,
            "down_proj": f + h,
        }  # in + out
        if unknown := [t for t in targets.split(",") if t not in sizes]:
            raise ValueError(f"--lora-targets {unknown[0]}: the plan knows a Llama/Qwen2 layer's {', '.join(sizes)}")
        return self.layers * rank * sum(sizes[t] for t in targets.split(","))

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding * (1 if self.tied else 2) + self.hidden


SHAPES = {  # the models the presets name; anything else is read from its folder's config.json
    "Qwen/Qwen2.5-1.5B": Shape(
        hidden=1536,
        layers=28,
        heads=12,
        kv_heads=2,
        intermediate=8960,
        vocab=151936,
        head_dim=128,
        tied=True,
        qkv_bias=True,
    ),  # 1,543,714,304 parameters
    "Qwen/Qwen3-1.7B-Base": Shape(
        hidden=2048, layers=28, heads=16, kv_heads=8, intermediate=6144, vocab=151936, head_dim=128, tied=True
    ),  # + q/k RMSNorms, 7,168 parameters not counted
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152, head_dim=64),
}


def shape_from_config(config: dict) -> Shape:
    heads = config["num_attention_heads"]
    return Shape(
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        tied=config.get("tie_word_embeddings", False),
        qkv_bias=config.get("attention_bias", config.get("model_type") == "qwen2"),
    )


def model_shape(model: str) -> Shape:
    """The shape of a preset's model, or of a local Hugging Face folder; ValueError (one line) otherwise."""
    if model in SHAPES:
        return SHAPES[model]
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no shape known for model {model!r}: pass a local Hugging Face folder with a config.json")
    try:
        with open(path) as f:
            return shape_from_config(json.load(f))
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a Llama/Qwen2-style config ({type(err).__name__}: {err})") from None


def training_state(shape: Shape, *, ranks: int, unsharded_grads: bool, lora: int = 0) -> dict:
    """Bytes of float32 parameters, gradients and AdamW moments on one rank (note 1 of the docstring); `lora`: the
    adapters' parameter count, then the only trained ones, beside the frozen base."""
    n, trained = shape.params + lora, lora or shape.params
    return {
        "params": 4 * n / ranks,
        "grads": 4 * trained if unsharded_grads else 4 * trained / ranks,
        "adam": 8 * trained / ranks,
    }


DTYPE_BYTES = {"bfloat16": 2, "float32": 4}  # --dtype, made concrete (config.resolve_auto)


def engine_share_error(shape: Shape, *, dtype: str, gpu_bytes: float, utilization: float, length: int) -> str | None:
    """One line when vLLM's share of the GPU (`utilization` x `gpu_bytes`) cannot hold the engine's `dtype` weights
    and the KV cache of one sequence of `length` tokens (the longest prompt + --max-tokens, its max_model_len), naming
    the smallest --gpu-memory-utilization that does (2 decimals, rounded up); None when it holds them.

    That KV cache is vLLM's own floor: below it vLLM V1 refuses to start ("To serve at least one request with the
    models's max seq len", vllm/v1/core/kv_cache_utils.py: check_enough_kv_cache_memory). It samples more sequences
    at once only with more KV cache, but starts without it (fewer run at a time), so max_num_seqs sets no floor.
    vLLM's activations and CUDA graphs come on top: a share that passes here may still be too small, one refused
    here always is."""
    size = DTYPE_BYTES[dtype]
    weights = size * shape.params
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * size * length  # keys and values, every layer
    need = weights + kv
    if need <= utilization * gpu_bytes:
        return None
    smallest = math.ceil(need / gpu_bytes * 100) / 100
    if smallest * gpu_bytes < need:  # the division rounded a hair below the ceiling's step
        smallest += 0.01
    # config.py's rule: --gpu-memory-utilization in (0, 1)
    answer = f"pass at least {smallest:.2f}" if smallest < 1 else "no share below 1 does: a larger GPU"
    return (
        f"--gpu-memory-utilization {utilization:g} gives vLLM {utilization * gpu_bytes / GiB:.1f} GiB of the GPU's "
        f"{gpu_bytes / GiB:.1f} GiB, below its {weights / GiB:.1f} GiB of {dtype} weights and {kv / GiB:.2f} GiB of "
        f"KV cache for one sequence of {length:,} tokens: {answer}"
    )


def hf_sampling_bytes(shape: Shape, *, rows: int, length: int, dtype: str) -> int:
    """rollout.py's sampling_bytes (the HF sampler's KV cache, logits and per-row work for `rows` x `length`) on
    `shape`: the same formula train.py's start-up holds against the free memory, not a copy of it."""
    from rollout import sampling_bytes  # here, not at the top: rollout imports transformers, which a vLLM plan skips

    config = SimpleNamespace(  # the model config fields sampling_bytes reads
        num_attention_heads=shape.heads,
        head_dim=shape.head_dim,
        hidden_size=shape.hidden,
        num_key_value_heads=shape.kv_heads,
        num_hidden_layers=shape.layers,
        vocab_size=shape.vocab,
    )
    return sampling_bytes(config, rows, length, dtype)


def activations(
    shape: Shape,
    *,
    batch: int,
    prompt: int,
    completion: int,
    compute_bytes: int,
    checkpointing: bool,
    attention: str,
    chunk_elements: int = CHUNK_ELEMENTS,
    frozen_head: bool = False,
    packed: bool = False,
) -> dict:
    """Peak bytes of one micro-batch's forward + backward beyond the training state, by part.

    `saved`: what the layers keep from forward to backward (and RoPE's cos/sin); `recompute`: one layer's
    recomputed activations (checkpointing) and the largest gradient its backward makes (attention: eager's
    float32 gradient of the probabilities, SDPA's dq/dk/dv); `weights_bf16`: the bf16 weight being cast;
    `logits`: the log-prob work, in row chunks of `chunk_elements` (speed.logprobs.CHUNK_ELEMENTS on a GPU;
    speed.logprobs.CPU_CHUNK_ELEMENTS on CPU, bench/plan_check.py's measurements); `head_grad`: the lm_head weight's
    gradient, float32 (a tied one kept until the embedding's backward); none with `frozen_head` (LoRA). `packed`
    (--pack): the `batch` sequences as one row of batch x (prompt + completion) tokens, so attention's keys span the
    whole row (eager's probabilities and SDPA's mask are T x T, block-diagonal but dense), and the logits are kept
    for the completion tokens only (speed/logprobs.py: pack_batch).
    `peak` (their sum) is the largest of forward's end, backward's first steps (logits, then the lm_head), a
    layer's backward (recompute) and its last step (the embedding's gradient); `when` names it.
    """
    h, f, c, S = shape.hidden, shape.intermediate, compute_bytes, prompt + completion
    tokens = batch * S  # all positions
    kept = batch * completion if packed else batch * (completion + 1)  # those with logits (logits_to_keep)
    span = tokens if packed else S  # the keys each query's attention row spans
    q = shape.heads * shape.head_dim
    qr = q if shape.kv_heads != shape.heads else shape.kv_heads * shape.head_dim
    per_token = 16 * h + (5 * c * h if c < 4 else 8 * h) + c * (2 * q + 2 * qr) + 4 * c * f
    shared = 2 * 4 * shape.head_dim * tokens  # RoPE's cos and sin, float32, saved once for every layer
    if attention == "eager":
        per_token += (4 + (c if c < 4 else 0)) * shape.heads * span
        backward_extra = 4 * shape.heads * span * tokens  # the probabilities' float32 gradient
    else:
        per_token += c * q + 4 * shape.heads
        backward_extra = c * (q + 2 * qr) * tokens  # dq, dk, dv
        shared += c * tokens * span  # the (B, 1, S, S) padding mask, which SDPA's memory-efficient kernel saves
    layer = per_token * tokens  # one decoder layer's saved activations, plain forward
    # Without checkpointing train.py reruns the norms and the MLP gate in backward
    # (speed/backward.py: recompute_norms_and_gates_in_backward): no normalised outputs (2 x 4h), no act_fn(gate) (cf);
    # under bf16 also no down_proj input (cf, rerun with the gate) and one bf16 cast of each norm's output
    # shared by the layers that read it (q/k/v, gate/up: 3ch less; speed/backward.py: _bf16_input)
    lean_layer = layer - (8 * h + c * f + (3 * c * h + c * f if c < 4 else 0)) * tokens
    head = shape.embedding  # the lm_head weight (tied or not), cast like any linear
    bf16_head = 2 * head if c < 4 else 0  # the lm_head's weight, cast for its forward and again in backward
    bf16_layer = 2 * max(h * f, h * q) if c < 4 else 0  # a layer's largest weight, cast as its matmul runs
    final_norm = (8 if checkpointing else 4) * h * tokens + c * h * kept  # final RMSNorm, all positions (input,
    # and its normalised output unless rerun); the lm_head's input on the completion rows
    logits = c * kept * shape.vocab
    chunk = 2 * 4 * min(kept, max(1, chunk_elements // shape.vocab)) * shape.vocab  # float32 chunk + a temporary
    # the lm_head's weight gradient: its matmul's output (bf16 under autocast), cast to float32. A tied weight's
    # then waits in autograd, through every layer's backward, for the embedding's to be added to it
    head_grad = 0 if frozen_head else 4 * head + (c * head if c < 4 else 0)
    waiting = 4 * head if shape.tied and not frozen_head else 0
    lm_head = {"weights_bf16": bf16_head, "final_norm": final_norm, "logits": logits, "head_grad": head_grad}
    # backward's last step: the embedding's dense float32 gradient, and with a tied weight the waiting one and
    # their sum (measured on CPU in float32; bf16's sum was made in place)
    embedding = {"head_grad": 0 if frozen_head else 4 * head + 2 * waiting}
    if not checkpointing:  # backward's first steps (logits' gradient twice, then the lm_head's), the last layer's
        saved = shape.layers * lean_layer + shared
        moments = {
            "backward (logits)": {
                "saved": saved,
                "weights_bf16": bf16_head,
                "final_norm": final_norm,
                "logits": 2 * logits + chunk,
            },
            "backward (lm_head)": {"saved": saved, **lm_head},
            "backward (last layer)": {
                "saved": saved,
                "weights_bf16": bf16_layer,
                "recompute": backward_extra,
                "head_grad": waiting,
            },
            "backward (embedding)": embedding,
        }
    else:
        saved = shape.layers * 4 * h * tokens + shared  # each layer's float32 input
        moments = {
            "forward end": {
                "saved": saved,
                "weights_bf16": bf16_head,
                "final_norm": final_norm,
                "logits": logits + chunk,
            },
            "backward (logits)": {
                "saved": saved,
                "weights_bf16": bf16_head,
                "final_norm": final_norm,
                "logits": 2 * logits + chunk,
            },
            "backward (lm_head)": {"saved": saved, **lm_head},
            "backward (a layer)": {
                "saved": saved,
                "weights_bf16": bf16_layer,
                "recompute": layer + backward_extra,
                "head_grad": waiting,
            },
            "backward (embedding)": embedding,
        }
    when = max(moments, key=lambda m: sum(moments[m].values()))
    parts = {
        "saved": 0,
        "weights_bf16": 0,
        "final_norm": 0,
        "logits": 0,
        "recompute": 0,
        "head_grad": 0,
        **moments[when],
    }
    return {**parts, "peak": sum(parts.values()), "when": when, "moments": moments}


@dataclass
class Plan:
    rows: list  # (phase, item, bytes, how)
    phases: dict  # phase -> bytes
    peak: float
    peak_phase: str
    gpu_bytes: float
    fits: bool
    assumptions: list
    engine_error: str | None = None  # engine_share_error's line: vLLM's share cannot hold its weights

    @property
    def verdict(self) -> str:
        if self.engine_error:  # vLLM would refuse to start on every rank, whatever the peak
            return f"does NOT fit: {self.engine_error}"
        word = "fits" if self.fits else "does NOT fit"
        return (
            f"{word}: peak {self.peak / GiB:.1f} GiB ({self.peak_phase}) of {self.gpu_bytes / GiB:.0f} GiB "
            f"per GPU ({self.peak / self.gpu_bytes:.0%})"
        )


def task_prompt_tokens(task: str) -> int:
    """The longest prompt `task` can meet, in tokens: train.py pads a micro-batch to its longest prompt and filters
    none, so the plan takes the task's own `prompt_tokens` (tasks.py; docs/tasks.md, "Prompt lengths": the official
    configs' data.max_prompt_length, 1024 for a task that does not say)."""
    tokens = getattr(TASKS.get(task), "prompt_tokens", None)  # a toy task of the tests may not be a tasks.Task
    if tokens is None:
        raise ValueError(f"no prompt length assumed for task {task!r}: pass prompt_tokens (--prompt-tokens)")
    return tokens


def plan(
    args: dict,
    *,
    gpus: int,
    gpu_gb: float,
    grad_checkpointing: bool,
    prompt_tokens: int | None = None,
    torchrun: bool | None = None,
) -> Plan:
    """One rank's peak GPU memory for train.py's `args` (a dict of its Args fields) on `gpus` GPUs of
    `gpu_gb` GiB each. `prompt_tokens`: the longest prompt (default: the task's, task_prompt_tokens). `torchrun`:
    whether train.py runs under torchrun, and so FSDP2 (default: when gpus > 1; one GPU under torchrun, as
    scripts/gpu_check.sh runs it, is FSDP2 over one rank: a float32 reference, gathers, foreach AdamW)."""
    shape = model_shape(args["model"])
    prompt = prompt_tokens if prompt_tokens is not None else task_prompt_tokens(args["task"])
    if gpus < 1 or not (math.isfinite(gpu_gb) and gpu_gb > 0) or prompt < 1:
        raise ValueError("the plan needs gpus >= 1, a finite gpu_gb > 0 and prompt_tokens >= 1")
    bf16 = args.get("dtype", "auto") in ("auto", "bfloat16")  # auto is bf16 on every GPU train.py targets
    c, K, ranks = 2 if bf16 else 4, args["max_tokens"], gpus
    per_minibatch = args["rollout_batch"] * args["M"] / (ranks * args.get("minibatches", 1))  # sequences, one rank
    batch = max(1, min(args["micro_batch"], math.ceil(per_minibatch)))
    budget = args.get("micro_batch_tokens", 0)  # speed/micro_batches.py: rows x (longest prompt + completion)
    if budget:  # at the longest prompt and completion, the rows the budget lets in (one, if one is longer)
        batch = min(batch, max(1, budget // (prompt + K)))
    packed = args.get("pack", False)
    accumulates = math.ceil(per_minibatch / args["micro_batch"]) > 1
    gpu = gpu_gb * GiB
    fsdp = ranks > 1 if torchrun is None else torchrun
    rank = args.get("lora_rank", 0)
    lora = shape.lora_params(rank, args.get("lora_targets", "q_proj")) if rank else 0
    state = training_state(shape, ranks=ranks, unsharded_grads=fsdp and accumulates, lora=lora)
    n, trained = shape.params, lora or shape.params
    beta = args.get("beta", 1e-3)
    reference = (
        0
        if beta == 0 or lora
        else (
            4 * n / ranks
            if fsdp or not bf16
            else 2 * (n - shape.embedding - (2 * shape.layers + 1) * shape.hidden)
            + 4 * (shape.embedding + (2 * shape.layers + 1) * shape.hidden)
        )
    )
    utilization = args.get("gpu_memory_utilization", 0.3)
    vllm = utilization * gpu
    engine = dict(dtype="bfloat16" if bf16 else "float32", gpu_bytes=gpu, utilization=utilization, length=prompt + K)
    hf = args.get("sampler") == "hf"  # "auto" is vLLM on a GPU: only an explicit --sampler hf samples with HF
    # the HF sampler takes no share of the GPU, so vLLM's start-up floor is not its to meet
    engine_error = None if hf else engine_share_error(shape, **engine)
    if hf:  # its own copy of the model, in the run's dtype, awake while it samples (its sleep frees it for training)
        rows_a_step = math.ceil(args["rollout_batch"] * args["M"] / ranks)  # this rank's samples, drawn at once
        sampler = (
            "hf sampler awake",
            c * n + hf_sampling_bytes(shape, rows=rows_a_step, length=prompt + K, dtype=engine["dtype"]),
            f"its own {engine['dtype']} weights + sampling {rows_a_step} x ({prompt} + {K}) tokens "
            "(rollout.py: sampling_bytes)",
        )
    else:
        sampler = ("vllm awake", vllm, f"gpu_memory_utilization {vllm / gpu:.2f} x GPU")
    act = activations(
        shape,
        batch=batch,
        prompt=prompt,
        completion=K,
        compute_bytes=c,
        checkpointing=grad_checkpointing,
        attention="sdpa",
        frozen_head=bool(lora),
        packed=packed,
    )
    root = c * (shape.embedding * (1 if shape.tied else 2) + shape.hidden)  # gathered: bf16 under mixed precision
    roots_left = 0 if not fsdp or ROOT_RESHARDED_AFTER_FORWARD else root * (1 + (beta > 0))  # policy + reference
    gathered = (0 if roots_left else root) + 2 * c * shape.layer_params if fsdp else 0
    grads_how = (
        ("the adapters'" if lora else "whole model") + ", float32: FSDP2 keeps unsharded gradients between "
        "micro-batches"
        if fsdp and accumulates
        else f"float32 / {ranks}" + (", the adapters'" * bool(lora))
    )
    frozen_casts = 2 * shape.layers * (shape.layer_params - 2 * shape.hidden) if lora and bf16 and not fsdp else 0
    resident = [
        ("params", state["params"], f"float32 / {ranks}" + (f" (+ {lora:,} adapter parameters)" if lora else "")),
        ("adamw", state["adam"], f"2 moments, float32 / {ranks}" + (", the adapters'" if lora else "")),
        (
            "reference",
            reference,
            "beta = 0: none"
            if beta == 0
            else "LoRA: the base (adapters off)"
            if lora
            else (f"float32 / {ranks} (FSDP2)" if fsdp else "bf16 linears" if bf16 else "float32"),
        ),
        (
            "fsdp2 roots gathered",
            roots_left,
            "one process: none"
            if not fsdp
            else "resharded after forward: none"
            if not roots_left
            else f"{'policy + reference' if beta > 0 else 'policy'}: embedding + "
            "final norm, left gathered after a forward",
        ),
        ("cuda overhead", CUDA_OVERHEAD, "context, NCCL, cuBLAS, slack (a constant)"),
    ]
    phases = {
        "rollout": resident + [sampler],
        "train": resident
        + [
            ("vllm asleep", VLLM_ASLEEP, "level 2: KV cache and weights dropped (a constant)"),
            ("grads", state["grads"], grads_how),
            (
                "fsdp2 gathered",
                gathered,
                f"{'' if roots_left else 'root (embedding) + '}2 decoder layers, {'bf16' if c < 4 else 'float32'}"
                if fsdp
                else "one process: none",
            ),
            (
                "activations",
                act["saved"],
                f"{batch} x ({prompt} + {K}) tokens{' packed in one row' if packed else ''}, "
                + ("layer inputs only (checkpointing)" if grad_checkpointing else "every layer's saved tensors"),
            ),
            *(
                [("lora frozen casts", frozen_casts, "frozen decoder linears' bf16 casts kept for backward, at most")]
                if frozen_casts
                else []
            ),
            (
                "bf16 weight cast",
                act["weights_bf16"] if not fsdp else 0,
                "float32: none"
                if c == 4
                else "FSDP2 gathers bf16 weights: none"
                if fsdp
                else "the one weight being cast at " + act["when"],
            ),
            (
                "layer backward",
                act["recompute"],
                ("one layer's recomputed activations + " if grad_checkpointing else "")
                + "its backward's largest gradient",
            ),
            ("final norm", act["final_norm"], "float32 on all positions; lm_head input on the kept rows"),
            (
                "logits + chunks",
                act["logits"],
                f"{'2 x ' if 'logits' in act['when'] else ''}({batch} x {K if packed else K + 1} x "
                f"{shape.vocab}) {'bf16' if c < 4 else 'float32'}"
                f"{' + float32 row chunks' if 'logits' in act['when'] or 'forward' in act['when'] else ''}",
            ),
            (
                "lm_head gradient",
                act["head_grad"],
                "float32 (+ bf16 as its matmul made it)"
                if "lm_head" in act["when"]
                else "the embedding's, float32 (+ a tied lm_head's, and their sum)"
                if "embedding" in act["when"]
                else "a tied weight's, waiting for the embedding's"
                if act["head_grad"]
                else "none at " + act["when"],
            ),
        ],
        "optimizer": resident
        + [
            ("vllm asleep", VLLM_ASLEEP, "level 2: KV cache and weights dropped (a constant)"),
            (
                "grads",
                state["grads"] if not fsdp else 4 * trained / ranks,
                f"float32 / {ranks}" if not fsdp else f"float32 / {ranks}: reduce-scattered by the last micro-batch",
            ),
            (
                "adamw temporary",
                4 * trained / ranks if fsdp else 0,
                f"foreach AdamW on FSDP2's shards: sqrt of the second moment, float32 / {ranks}"
                if fsdp
                else "fused AdamW (one process): none",
            ),
        ],
        "sync": resident
        + [
            ("vllm weights", 2 * n, "woken alone for the reload; its KV cache wakes after"),
            (
                "one full parameter",
                (4 if bf16 else 8) * shape.embedding,
                "full_weights, streamed in the engine's dtype: the largest, the embedding, gathered + "
                "vLLM's build of it",
            ),
        ],
    }
    rows = [(phase, item, size, how) for phase, items in phases.items() for item, size, how in items]
    totals = {phase: sum(size for _, size, _ in items) for phase, items in phases.items()}
    peak_phase = max(totals, key=totals.get)
    assumptions = [
        f"{args['model']}: {n / 1e9:.3f}B parameters; longest prompt {prompt} tokens, completion {K}",
        f"{ranks} rank(s); {per_minibatch:.0f} sequences per rank per minibatch in micro-batches of {batch}"
        + (f" (--micro-batch-tokens {budget}, every sequence at its longest)" if budget else ""),
        "the trainer empties the CUDA cache before vLLM wakes (else the rollout phase also holds the train phase's "
        "cached blocks)",
    ]
    fits = totals[peak_phase] <= gpu and not engine_error
    return Plan(rows, totals, totals[peak_phase], peak_phase, gpu, fits, assumptions, engine_error)


def calibration(item: str) -> str:
    """What backs a row: "gpu" (calibrated on a GPU, GPU_CALIBRATED), "cpu" (checked against CPU peaks in one
    process; a GPU estimate) or "estimate"; KeyError for a row nobody has classified."""
    if item in GPU_CALIBRATED:
        return "gpu"
    return {**dict.fromkeys(ESTIMATED, "estimate"), **dict.fromkeys(CPU_CHECKED, "cpu")}[item]


def trainer_allocated(p: Plan) -> dict:
    """Bytes per phase as train.py measures them (plumbing/run_log.py: Phases's mem/peak_gb/PHASE, torch's
    allocated peak less the engine's): the plan's rows without the engine's and without what torch's allocator never
    counts (CUDA_OVERHEAD). The measured train phase holds the optimizer step, so it is the larger of the two."""
    totals = {
        phase: sum(
            size
            for ph, item, size, _ in p.rows
            if ph == phase and item not in ENGINE_ROWS and item not in OUTSIDE_ALLOCATOR
        )
        for phase in p.phases
    }
    return {"rollout": totals["rollout"], "train": max(totals["train"], totals["optimizer"]), "sync": totals["sync"]}


def format_plan(p: Plan, title: str = "") -> str:
    lines = [title] if title else []
    tag = {"gpu": "[gpu]", "cpu": "[cpu]", "estimate": "[est]"}
    for phase, total in p.phases.items():
        lines.append(f"{phase:<9} {total / GiB:8.2f} GiB")
        lines += [
            f"  {item:<20} {size / GiB:8.2f}  {tag[calibration(item)]} {how}"
            for ph, item, size, how in p.rows
            if ph == phase
        ]
    lines += [f"assumes: {a}" for a in p.assumptions]
    lines.append(
        "[gpu] calibrated on a GPU (docs/gpu.md); [cpu] checked against CPU peaks in one process, on a GPU "
        "an estimate; [est] arithmetic or an assumed constant. "
        + (
            f"GPU-calibrated rows: {', '.join(sorted(GPU_CALIBRATED))}"
            if GPU_CALIBRATED
            else "No row has been calibrated on a GPU yet: every figure is an estimate."
        )
    )
    lines.append(p.verdict)
    return "\n".join(lines)


def paper_table(presets: dict, defaults: dict) -> str:
    """A markdown table: every paper preset on its Table B.1/B.2 hardware, with and without checkpointing."""
    lines = [
        "| preset | GPUs | micro-batch x (prompt + response) | peak, checkpointing | peak, none |",
        "| --- | --- | --- | --- | --- |",
    ]
    for task, (gpus, card, gb) in PAPER_HARDWARE.items():
        args = {**defaults, **presets[task], "task": task}
        cells = []
        for ckpt in (True, False):
            p = plan(args, gpus=gpus, gpu_gb=gb, grad_checkpointing=ckpt)
            cells.append(f"{p.peak / GiB:.1f} GiB ({p.peak_phase}): {'fits' if p.fits else '**does not fit**'}")
        lines.append(
            f"| {task} | {gpus} x {card} ({gb} GiB) | {args['micro_batch']} x ({task_prompt_tokens(task)} + "
            f"{args['max_tokens']}) | {cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    from config import PRESETS, Args, check_args  # the presets live with the flags they set
    from plumbing.cli import OneLineParser

    parser = OneLineParser("memory_plan.py", description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="deepmath", help=f"a preset of train.py: {', '.join(PRESETS)}")
    parser.add_argument("--gpus", type=int, default=8, help="ranks (one GPU each)")
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="memory per GPU, GiB")
    parser.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--prompt-tokens", type=int, help="longest prompt (default: the task's assumption)")
    parser.add_argument("--model", help="override the preset's model (a local folder with config.json)")
    parser.add_argument("--table", action="store_true", help="every paper preset on its paper hardware, markdown")
    cli = parser.parse_args(argv)
    if cli.table:
        print(paper_table(PRESETS, Args().__dict__))
        return 0
    if cli.task not in PRESETS:
        parser.error(f"--task must be one of {', '.join(PRESETS)}")
    args = {**Args().__dict__, **PRESETS[cli.task], "task": cli.task, **({"model": cli.model} if cli.model else {})}
    # train.py's own checks of these flags on these GPUs (as train.py --plan): a plan train.py would refuse is none
    if error := check_args(Args(**{**args, "plan": True, "plan_gpus": cli.gpus, "plan_gpu_gb": cli.gpu_gb})):
        parser.error(error.replace("--plan-gpu-gb", "--gpu-gb").replace("--plan-gpus", "--gpus"))
    try:
        p = plan(
            args,
            gpus=cli.gpus,
            gpu_gb=cli.gpu_gb,
            grad_checkpointing=cli.grad_checkpointing,
            prompt_tokens=cli.prompt_tokens,
        )
    except ValueError as err:
        print(f"memory_plan.py: error: {err}", file=sys.stderr)
        return 2
    ckpt = "with" if cli.grad_checkpointing else "without"
    print(format_plan(p, f"{cli.task} on {cli.gpus} x {cli.gpu_gb:g} GiB, {ckpt} gradient checkpointing"))
    return 0


def print_plan(args) -> int:
    """train.py --plan: format_plan for these flags on --plan-gpus x --plan-gpu-gb; the exit status."""
    try:
        p = plan(asdict(args), gpus=args.plan_gpus, gpu_gb=args.plan_gpu_gb, grad_checkpointing=args.grad_checkpointing)
    except ValueError as err:
        print(f"train.py: error: --plan: {err}", file=sys.stderr)
        return 2
    ckpt = "with" if args.grad_checkpointing else "without"
    print(
        format_plan(
            p,
            f"{args.task} ({args.model}) on {args.plan_gpus} x {args.plan_gpu_gb:g} GiB, {ckpt} gradient checkpointing",
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
