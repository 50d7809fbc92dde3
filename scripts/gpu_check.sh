#!/usr/bin/env bash
# GPU check for train.py: a few SoftmaxGRPO steps of a randomly initialised Qwen2.5-1.5B-shaped model
# (28 layers, hidden 1536, vocab 151936, tied embeddings) on one GPU, with the HF sampler, under
# `torchrun --nproc_per_node 1` (FSDP2 over NCCL) in bf16 autocast. Needs torch and this repo's
# requirements only: no vLLM, no network (the tokenizer is built in code). Prints tokens/s and MFU.
#
#   bash scripts/gpu_check.sh [work_dir]          # default work dir: a fresh mktemp -d
#   GPU_CHECK_TINY=1 bash scripts/gpu_check.sh    # 2-layer model: a dry run of this script on a CPU
#
# MFU = model FLOPs per second / peak dense bf16 FLOP/s of the GPU (PEAK_TFLOPS overrides the table
# below). Model FLOPs count 2 per parameter per token per forward pass (x3 with backward), for the
# sampler's pass, the reference pass and the training pass (train.py's perf/tflops); attention's
# quadratic term is left out, so with 256-token responses MFU is slightly understated.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-$(mktemp -d)}
STEPS=${STEPS:-5}
mkdir -p "$WORK"
rm -rf "$WORK/run"

python3 - "$WORK/model" <<'EOF'
import os, string, sys

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

path, tiny = sys.argv[1], os.environ.get("GPU_CHECK_TINY") == "1"
if os.path.exists(os.path.join(path, "config.json")):
    sys.exit(0)
vocab_size = 151936  # Qwen2.5's embedding rows
special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
chars = list(string.printable[:95]) + ["\n"]
filler = [f"<t{i}>" for i in range(vocab_size - len(special) - len(chars))]  # plain tokens up to full size
core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(special + chars + filler)}, merges=[],
                            unk_token="<|endoftext|>"))  # no merges: one token per character
core.decoder = decoders.Fuse()
tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                              additional_special_tokens=["<|im_start|>"])
tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
config = Qwen2Config(  # Qwen/Qwen2.5-1.5B's shapes
    vocab_size=vocab_size, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2 if tiny else 28,
    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
    rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
torch.manual_seed(0)
model = Qwen2ForCausalLM(config).to(torch.bfloat16)  # random weights; train.py loads them as float32
model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
model.save_pretrained(path)
tok.save_pretrained(path)
print(f"random Qwen2.5-1.5B-shaped model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
EOF

if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then SIZE=(--rollout-batch 2 --M 2 --max-tokens 8); else
  SIZE=(--rollout-batch 16 --M 8 --max-tokens 256 --micro-batch 16); fi
torchrun --nproc_per_node 1 train.py --model "$WORK/model" --task arith --sampler hf --dtype bfloat16 \
  --steps "$STEPS" --eval-examples 0 --lr 1e-6 --out-dir "$WORK/run" "${SIZE[@]}"

python3 - "$WORK/run/metrics.jsonl" <<'EOF'
import json, os, sys

import torch

rows = [json.loads(line) for line in open(sys.argv[1])]
steady = rows[1:] or rows  # the first step pays for allocator warmup and kernel selection
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
peaks = {"H200": 989, "H100": 989, "H800": 989, "A100": 312, "A800": 312, "L40S": 362, "L4": 121, "A10": 125}
peak = float(os.environ.get("PEAK_TFLOPS") or next((v for k, v in peaks.items() if k in name), 0))
mean = lambda key: sum(r[key] for r in steady) / len(steady)
print(f"device: {name}; steps measured: {len(steady)} of {len(rows)}")
print(f"step time {mean('time/step'):.2f} s (rollout {mean('time/rollout'):.2f}, train {mean('time/train'):.2f}, "
      f"weight sync {mean('time/sync'):.2f}); response length {mean('response/len_mean'):.0f} tokens")
print(f"response tokens/s (sampled, scored and trained): {mean('perf/tokens_per_s'):.0f}")
print(f"model TFLOP/s: {mean('perf/tflops'):.1f}" + (f"; MFU {100 * mean('perf/tflops') / peak:.1f}% of "
      f"{peak:.0f} TFLOP/s bf16 dense" if peak else " (unknown peak: set PEAK_TFLOPS for MFU)"))
print(f"sampler-trainer log-prob diff: rollout mean {mean('sync/rollout_logprob_diff'):.4f}, "
      f"probe max {mean('sync/logprob_diff'):.4f}; finite losses: "
      f"{all(abs(r['loss/pg']) < float('inf') and abs(r['loss/kl']) < float('inf') for r in rows)}")
EOF
