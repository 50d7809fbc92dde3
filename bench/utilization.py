"""How close training and sampling come to this machine's dense matmul throughput (model FLOP utilisation).

1. Peak: a 2048^3 matmul (2 n^3 FLOP) in bfloat16 and float32 on all cores, best of several runs.
2. Training phase: train.py's `ppo_update` (reference forward, policy forward + backward of the
   PPO-clip + KL loss via sequence_logprobs / policy_loss under bfloat16 autocast, AdamW step) on a
   fixed batch: 4 real `arith` prompts (about 40 tokens with the chat template) x M = 8, each with a
   64-token random completion, in micro-batches of 8. Also its two parts alone: the reference forward
   and the loss forward + backward.
3. Sampler: rollout.make_sampler("hf") generating 4 prompts x 8 completions of up to 64 tokens.

Model FLOPs counted (PaLM's convention, arXiv 2204.02311 App. B; padding and the skipped prompt logits
not counted), per sequence of S real tokens of which K are completion tokens:
    forward  F = 2 * N_body * S + 2 * N_head * K + 4 * L * d * S^2
    (N_body: parameters outside the embedding/lm_head, N_head = V * d: the lm_head, computed for the K
    completion positions only; 4 L d S^2: QK^T and AV in each of L layers of width d, no causal halving)
    forward + backward = 3F; ppo_update = 3F + F (the reference forward; one PPO epoch on-policy needs no
    old-log-prob forward). Sampler bounds: 2 * (N_body + N_head) FLOP per generated token at the matmul
    peak, and (a decode step reads all bfloat16 weights once) rows x bandwidth / weight bytes tokens/s,
    with the bandwidth of a 256 MB tensor copy.

    python bench/utilization.py                          # SmolLM2-135M, ~3 min on 2 cores
    python bench/utilization.py --model /tmp/tiny --iters 1 --max-tokens 8     # smoke test
"""

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def timed(fn, iters: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def matmul_flops(n: int, dtype: torch.dtype, iters: int = 10) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best = min(timed(lambda: torch.mm(a, b), iters, warmup=3))
    return 2 * n**3 / best


def copy_bandwidth(n_bytes: int = 1 << 28, iters: int = 5) -> float:
    """Bytes per second read + written by a large tensor copy: what a memory-bound decode step can reach."""
    a = torch.ones(n_bytes // 4)
    b = torch.empty_like(a)
    best = min(timed(lambda: b.copy_(a), iters, warmup=1))
    return 2 * n_bytes / best


def forward_flops(seq_lens, n_completion, n_body, n_head, layers, width) -> float:
    """Model FLOPs of one forward over sequences of `seq_lens` real tokens, `n_completion` scored each."""
    return sum(2 * n_body * s + 2 * n_head * k + 4 * layers * width * s * s for s, k in zip(seq_lens, n_completion))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="arith")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--M", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64, help="completion length (training), max new (sampler)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=3, help="timed iterations after one warm-up")
    parser.add_argument("--size", type=int, default=2048, help="matmul size n")
    parser.add_argument("--skip", default="", help="comma list of: train, sampler")
    opts = parser.parse_args()
    skip = set(filter(None, opts.skip.split(",")))
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)

    from transformers import AutoTokenizer

    import train
    from loss import policy_loss
    from plumbing.models import load_model
    from rollout import make_sampler, resolve_model
    from speed.allocator import keep_freed_memory
    from speed.logprobs import pad_batch, sequence_logprobs
    from tasks import encode_prompts, get_task

    keep_freed_memory()  # as train.main does on CPU
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}")
    peak = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        peak[name] = matmul_flops(opts.size, dtype)
        print(f"matmul {opts.size}^3 {name:<9}: {peak[name] / 1e9:8.0f} GFLOP/s")

    bandwidth = copy_bandwidth()
    print(f"memory bandwidth (256 MB copy, read + write): {bandwidth / 1e9:.1f} GB/s")

    model_path = resolve_model(opts.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    examples = get_task(opts.task).load("train", limit=opts.prompts, seed=0)
    prompt_ids = encode_prompts(tokenizer, examples)
    model = load_model(model_path)  # as train.main builds it: float32 master weights, CPU attention kernel
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    n_head = model.get_output_embeddings().weight.numel()
    n_body = n_params - model.get_input_embeddings().weight.numel() - (0 if cfg.tie_word_embeddings else n_head)
    layers, width = (
        cfg.num_hidden_layers,
        cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
    )
    print(
        f"model {model_path}: {n_params / 1e6:.1f}M parameters, N_body {n_body / 1e6:.1f}M, "
        f"N_head {n_head / 1e6:.1f}M, {layers} layers, attention width {width}"
    )

    if "train" not in skip:
        args = train.Args(
            M=opts.M,
            rollout_batch=opts.prompts,
            micro_batch=opts.micro_batch,
            minibatches=1,
            ppo_epochs=1,
            max_tokens=opts.max_tokens,
            warmup_steps=0,
            dtype="bfloat16",
        )
        ref_model = train.load_reference(model_path, args, torch.device("cpu"))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        special = set(tokenizer.all_special_ids)
        vocab = [t for t in range(cfg.vocab_size) if t not in special][:20000]
        pick = torch.randint(len(vocab), (opts.prompts * opts.M, opts.max_tokens))
        completions = [[vocab[i] for i in row] for row in pick.tolist()]  # full length: no EOS, no padding
        prompts = [p for p in prompt_ids for _ in range(opts.M)]
        sampler_logps = [[0.0] * opts.max_tokens for _ in completions]
        adv = torch.randn(len(prompts))  # (B,)
        optimizer = train.make_optimizer(model, args)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        seq_lens = [len(p) + opts.max_tokens for p in prompts]
        fwd = forward_flops(seq_lens, [opts.max_tokens] * len(prompts), n_body, n_head, layers, width)
        tokens = sum(seq_lens)

        def loss_fwd_bwd():
            for a in range(0, len(prompts), opts.micro_batch):
                b = a + opts.micro_batch
                ids, attn, mask = pad_batch(prompts[a:b], completions[a:b], pad_id)  # (B, P+K) x2, (B, K)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logp = sequence_logprobs(model, ids, attn, mask.shape[1])  # (B, K)
                loss, _ = policy_loss(
                    logp, logp.detach(), adv[a:b], mask, denominator=len(prompts) * opts.max_tokens
                )  # whole-batch denominator
                loss.backward()
            model.zero_grad(set_to_none=True)

        def reference_forward():  # as ppo_update runs it: no grad, bf16 autocast, per micro-batch
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                for a in range(0, len(prompts), opts.micro_batch):
                    ids, attn, mask = pad_batch(
                        prompts[a : a + opts.micro_batch], completions[a : a + opts.micro_batch], pad_id
                    )
                    sequence_logprobs(ref_model, ids, attn, mask.shape[1])

        def ppo_update():
            train.ppo_update(
                model, ref_model, optimizer, scheduler, prompts, completions, sampler_logps, adv, args, pad_id
            )

        print(
            f"\ntraining batch: {len(prompts)} sequences, {tokens} tokens "
            f"(prompts {min(map(len, prompts))}-{max(map(len, prompts))} + {opts.max_tokens} completion), "
            f"micro-batch {opts.micro_batch}, bfloat16 autocast"
        )
        for name, fn, flops in (
            ("reference forward (no grad)", reference_forward, fwd),
            ("loss forward+backward", loss_fwd_bwd, 3 * fwd),
            ("ppo_update (ref fwd + fwd/bwd + AdamW)", ppo_update, 4 * fwd),
        ):
            times = timed(fn, opts.iters)
            sec = statistics.median(times)
            achieved = flops / sec
            print(
                f"{name:<40}: {sec:6.2f} s [{min(times):.2f}-{max(times):.2f}], {tokens / sec:7.0f} tok/s, "
                f"{achieved / 1e9:6.0f} GFLOP/s = {achieved / peak['bfloat16']:5.1%} of bf16 matmul "
                f"({achieved / peak['float32']:.2f}x fp32 matmul)"
            )
        del ref_model, optimizer

    if "sampler" not in skip:
        del model
        sampler = make_sampler("hf", model_path, dtype="bfloat16", seed=0)
        calls = iter(range(1000))

        def sample():
            groups = sampler.generate(
                prompt_ids, n=opts.M, max_tokens=opts.max_tokens, temperature=1.0, seed=next(calls)
            )
            sample.lengths = [len(c.token_ids) for g in groups for c in g]

        times = timed(sample, opts.iters)
        sec = statistics.median(times)
        rows = opts.prompts * opts.M
        useful = sum(sample.lengths)  # tokens of the last call (seeded per call; lengths vary a little)
        flop_bound = peak["bfloat16"] / (2 * (n_body + n_head))
        # A decode step also reads every bfloat16 weight once, whatever the number of rows: at `rows`
        # sequences per step that caps tokens/s at rows * bandwidth / weight bytes.
        byte_bound = rows * bandwidth / (2 * (n_body + n_head))
        tok_s = useful / sec
        print(
            f"\nsampler (hf, bfloat16): {rows} sequences x <= {opts.max_tokens} new tokens, {sec:.2f} s per call "
            f"[{min(times):.2f}-{max(times):.2f}], {useful} tokens, {tok_s:.0f} tok/s, "
            f"{max(sample.lengths) / sec:.1f} decode steps/s"
        )
        print(
            f"sampler FLOP bound (2 x {(n_body + n_head) / 1e6:.1f}M FLOP per token at the bf16 matmul peak): "
            f"{flop_bound:.0f} tok/s; achieved {tok_s / flop_bound:.1%}"
        )
        print(
            f"sampler weight-read bound ({rows} rows per step, {2 * (n_body + n_head) / 1e6:.0f} MB of weights per "
            f"step at {bandwidth / 1e9:.1f} GB/s): {byte_bound:.0f} tok/s; achieved {tok_s / byte_bound:.1%}"
        )
        sampler.close()


if __name__ == "__main__":
    main()
