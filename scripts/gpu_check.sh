#!/usr/bin/env bash
# What a user with GPUs runs first: train.py's headline path on a randomly initialised Qwen2.5-1.5B-shaped model
# (28 layers, hidden 1536, vocab 151936, tied embeddings): torchrun, one colocated vLLM engine per rank (vLLM's
# external launcher, sleep mode), FSDP2 on NCCL with bf16 mixed precision, the streamed weight sync and its
# check, gradient checkpointing, top_p 0.999, held-out evaluation, a checkpoint, and a resume from it for one
# more step. It runs `torchrun --nproc_per_node N` for N = 1 .. the GPU count (NPROCS="1 8" picks some), so
# one GPU already exercises every piece. Needs this repo's requirements, vLLM (requirements-vllm.txt) and a C
# compiler (torch and vLLM compile kernels); no network: the tokenizer is built in code, the hub set offline.
#
# From metrics.jsonl, where each rank's own measurements sit as name/rankR, it reports each rank's device, the
# device memory in use before and after its engine sleeps, the trainer's peak allocated memory per phase (the
# engine's allocations left out) and the sampler-trainer log-prob difference. It FAILS when two ranks share a
# device, when sleep frees less than half of the engine's memory (--gpu-memory-utilization of the device), when
# a phase's trainer peak exceeds tools/memory_plan.py's trainer rows by more than 15%, or when the sync
# difference exceeds train.py's tolerance.
#
#   bash scripts/gpu_check.sh [work_dir]          # default work dir: a fresh mktemp -d
#   bash scripts/gpu_check.sh --dry-run [dir]     # tiny model on the CPU: torchrun over gloo, the HF sampler
#
# MFU = model FLOPs per second / peak dense bf16 FLOP/s of the GPU (PEAK_TFLOPS overrides the table
# below), from train.py's perf/tflops: 2 FLOPs per parameter per token per forward pass (x3 with backward).
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
WORK=${1:-$(mktemp -d)}
PY=${PYTHON:-python3}
STEPS=${STEPS:-4}
[ "$STEPS" -ge 2 ] || { echo "gpu_check.sh: STEPS must be >= 2 (a save, then a resumed step)" >&2; exit 2; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # a random model and a tokenizer built here: nothing to download
if ! command -v "${CC:-cc}" >/dev/null && ! command -v gcc >/dev/null; then
  echo "gpu_check.sh: no C compiler (cc or gcc) on PATH: torch and vLLM compile kernels at run time" >&2
  exit 1
fi
mkdir -p "$WORK"
rm -rf "$WORK"/run-*

"$PY" - "$WORK/model" "$DRY" <<'EOF'
import os, string, sys

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

path, dry = sys.argv[1], sys.argv[2] == "1"
if os.path.exists(os.path.join(path, "config.json")):
    sys.exit(0)
vocab_size = 512 if dry else 151936  # Qwen2.5's embedding rows
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
shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1) if dry else dict(  # Qwen/Qwen2.5-1.5B's shapes
             hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
             num_key_value_heads=2)
config = Qwen2Config(vocab_size=vocab_size, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **shape)
torch.manual_seed(0)
model = Qwen2ForCausalLM(config).to(torch.bfloat16)  # random weights; train.py loads them as float32
model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
model.save_pretrained(path)
tok.save_pretrained(path)
print(f"random Qwen2.5-shaped model: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters")
EOF

if [ "$DRY" = 1 ]; then
  GPUS=1  # one CPU process under torchrun (gloo)
  SAMPLER=hf
  SIZE=(--rollout-batch 2 --M 2 --max-tokens 8 --dtype float32 --eval-examples 2)
else
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  [ "$GPUS" -ge 1 ] || { echo "gpu_check.sh: no GPU visible to torch (use --dry-run on a CPU)" >&2; exit 1; }
  SAMPLER=vllm
  SIZE=(--rollout-batch 16 --M 8 --max-tokens 256 --micro-batch 16 --dtype bfloat16 --gpu-memory-utilization 0.3
        --eval-examples 16)
fi
NPROCS=${NPROCS:-$(seq -s " " 1 "$GPUS")}
SAVE=$((STEPS - 1))  # a checkpoint one step before the end; the resume runs the last step from it
COMMON=(--model "$WORK/model" --task arith --sampler "$SAMPLER" --lr 1e-6 --grad-checkpointing --top-p 0.999
        --eval-every 2 --save-every "$SAVE")

for N in $NPROCS; do
  echo "== torchrun --nproc_per_node $N: $SAMPLER sampler, one engine per rank"
  MORE=("${SIZE[@]}")
  MORE[1]=$((SIZE[1] * N))  # --rollout-batch: the same prompts per rank at every N
  TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$N" train.py "${COMMON[@]}" "${MORE[@]}")
  "${TORCHRUN[@]}" --steps "$SAVE" --out-dir "$WORK/run-$N"
  "${TORCHRUN[@]}" --steps "$STEPS" --resume "$WORK/run-$N"  # from checkpoint-$SAVE, one more step
done

# shellcheck disable=SC2086  # NPROCS: one argument per N
"$PY" - "$WORK" "$DRY" $NPROCS <<'EOF'
import json, os, sys

from config import SYNC_TOLERANCE

work, dry, runs = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
failures = []
name, peak, total_gb = "cpu", 0.0, 0.0
if not dry:
    import torch

    name = torch.cuda.get_device_name(0)
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    peaks = {"H200": 989, "H100": 989, "H800": 989, "A100": 312, "A800": 312, "L40S": 362, "L4": 121, "A10": 125}
    peak = float(os.environ.get("PEAK_TFLOPS") or next((v for k, v in peaks.items() if k in name), 0))
for ranks in runs:
    rows = [json.loads(line) for line in open(f"{work}/run-{ranks}/metrics.jsonl")]
    steps = [r["step"] for r in rows]
    if steps != list(range(1, len(rows) + 1)) or len(rows) < 2:
        failures.append(f"{ranks}-rank run: metrics.jsonl holds steps {steps} after the resume")
    steady = rows[1:] or rows  # the first step pays for allocator warmup and kernel selection
    mean = lambda key: sum(r[key] for r in steady) / len(steady)
    print(f"-- {ranks} rank(s) on {name}; steps measured: {len(steady)} of {len(rows)}, the last one resumed")
    print(f"step time {mean('time/step'):.2f} s (rollout {mean('time/rollout'):.2f}, train {mean('time/train'):.2f}, "
          f"weight sync + check {mean('time/sync'):.2f}); response length {mean('response/len_mean'):.0f} tokens")
    print(f"response tokens/s (sampled, scored and trained): {mean('perf/tokens_per_s'):.0f}")
    print(f"model TFLOP/s: {mean('perf/tflops'):.1f}" + (f"; MFU {100 * mean('perf/tflops') / (peak * int(ranks)):.1f}% "
          f"of {peak:.0f} TFLOP/s bf16 dense per GPU" if peak else " (unknown peak: set PEAK_TFLOPS for MFU)"))
    worst = max(r["sync/logprob_diff"] for r in rows)
    scores = [round(r["eval/score"], 3) for r in rows if "eval/score" in r]
    print(f"sampler-trainer log-prob difference: probe max {worst:.2e}, rollout mean "
          f"{mean('sync/rollout_logprob_diff'):.2e}; held-out scores {scores}")
    tolerance = SYNC_TOLERANCE["float32" if dry else "bfloat16"]  # what train.py stops at
    if worst > tolerance:
        failures.append(f"{ranks}-rank run: the sync difference reached {worst:.3g} > {tolerance}")
    if dry:
        continue
    from tools.memory_plan import GiB, plan

    run_args = dict(model=f"{work}/model", task="arith", M=8, rollout_batch=16 * int(ranks), micro_batch=16,
                    max_tokens=256, dtype="bfloat16", gpu_memory_utilization=0.3, beta=1e-3)
    p = plan(run_args, gpus=int(ranks), gpu_gb=total_gb * 1e9 / GiB, grad_checkpointing=True, prompt_tokens=128)
    # the trainer's part of each phase: the plan's rows without vLLM's, as mem/peak_gb leaves the engine out
    planned = {ph: sum(size for phase, item, size, _ in p.rows if phase == ph and not item.startswith("vllm")) / 1e9
               for ph in ("rollout", "train", "sync")}
    devices = {}
    for r in range(int(ranks)):
        device = int(rows[-1][f"mem/device/rank{r}"])
        devices.setdefault(device, []).append(r)
        awake = max(row[f"mem/used_before_sleep_gb/rank{r}"] for row in rows)
        asleep = max(row[f"mem/used_after_sleep_gb/rank{r}"] for row in rows)
        phases = {p: max(row[f"mem/peak_gb/{p}/rank{r}"] for row in rows) for p in ("rollout", "train", "sync")}
        print(f"rank {r} on cuda:{device}: device memory {awake:.1f} GB awake, {asleep:.1f} GB asleep; trainer peak "
              "allocated " + ", ".join(f"{ph} {gb:.1f} (plan {planned[ph]:.1f})" for ph, gb in phases.items()) + " GB")
        if awake - asleep < 0.5 * 0.3 * total_gb:  # --gpu-memory-utilization 0.3
            failures.append(f"{ranks}-rank run: rank {r}'s sleep freed {awake - asleep:.1f} GB, under half its engine's")
        for ph, gb in phases.items():
            if gb > 1.15 * planned[ph]:
                failures.append(f"{ranks}-rank run: rank {r}'s trainer peaked at {gb:.1f} GB in {ph}, over 1.15 x the "
                                f"plan's {planned[ph]:.1f} GB")
    for device, holders in devices.items():
        if len(holders) > 1:
            failures.append(f"{ranks}-rank run: ranks {holders} share cuda:{device}")
for failure in failures:
    print(f"gpu_check.sh: FAIL: {failure}", file=sys.stderr)
print("gpu_check.sh: " + ("FAILED" if failures else "ok"))
sys.exit(1 if failures else 0)
EOF
