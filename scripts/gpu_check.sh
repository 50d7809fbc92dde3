#!/usr/bin/env bash
# What a user with GPUs runs first: train.py's headline path on a randomly initialised Qwen2.5-1.5B-shaped model
# (28 layers, hidden 1536, vocab 151936, tied embeddings) under `torchrun --nproc_per_node N`: FSDP2 on NCCL with
# bf16 mixed precision, one sampler per rank, the streamed weight sync and its check, gradient checkpointing,
# top_p 0.999, held-out evaluation, a checkpoint, and a resume from it for one more step at lr 1e-3 (it must move
# the engine's probe further than the engine differs from the trainer, or the sync gate fails); then a LoRA leg
# (rank 16, the reference the base through disable_adapter, top-k and min-p, the merged-weight sync and weight
# check at every step, STEPS steps, no save), which --quick and --dry-run skip when their clock (BUDGET_S, 8
# minutes) has no room left for it. The sampler is
# vLLM where it is importable, else the HF sampler: the same torchrun path, and the first line says which. No
# network: the tokenizer is built in code and the hub is set offline. docs/gpu.md explains each verdict line.
#
#   bash scripts/gpu_check.sh [work_dir]             # N = 1 and the GPU count (NPROCS="1 2 8" picks others)
#   bash scripts/gpu_check.sh --quick [work_dir]     # N = 1, 3 steps, a one-screen verdict: for a short GPU loan
#   bash scripts/gpu_check.sh --dry-run [work_dir]   # the no-vLLM path on the CPU: gloo, a 2-layer model
#
# Before the first run, one line each: packages, a compiler (only where the path compiles), disk room and speed,
# GPU memory. Bounded: each torchrun runs under `timeout` (RUN_TIMEOUT s, plus twice the checkpoint's write time
# at the measured disk speed); the save run writes one checkpoint, the resumed run none (--no-final-save), and
# each N's is deleted after its resume; the work folder (default: a new folder on the filesystem with the most
# free space) is measured at its peak. The verdict: python -m tools.gpu_check. WORK/logs holds at most 8 files
# for --quick (one per torchrun, its exit status its last line; everything printed, the verdict last, in
# gpu_check.log; the disk's), so `tar -czf logs.tgz -C WORK logs` brings them back.
# Env: NPROCS, STEPS (>= 2), RUN_TIMEOUT, SAMPLER (hf: the HF sampler although vLLM is importable), PEAK_TFLOPS
# (for MFU), BUDGET_S and LORA_ESTIMATE_S (the clock and the LoRA leg's estimate, s), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0 QUICK=0
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1; shift ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check: unknown option $1 (use --quick, --dry-run or a work folder)" >&2; exit 2 ;;
    *) break ;;
  esac
done
PY=${PYTHON:-python3}
STEPS=${STEPS:-$([ "$QUICK" = 1 ] && echo 3 || echo 4)}
[ "$STEPS" -ge 2 ] || { echo "gpu_check: STEPS must be >= 2 (a save, then a resumed step)" >&2; exit 2; }
RUN_TIMEOUT=${RUN_TIMEOUT:-$([ "$DRY" = 1 ] && echo 300 || { [ "$QUICK" = 1 ] && echo 240 || echo 900; })}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1  # nothing to download, nothing to report
# The clock of --quick and --dry-run (issue 64: the quick check ends inside 8 minutes on one 80 GB GPU): the LoRA
# leg runs only when the time spent so far plus its estimate fits. The estimates are not measured on a GPU: its
# one launch of 3 steps, no evaluation and no save, about 100 s with the HF sampler, 150 to be safe; 26 s on
# the 2-core CPU, 60 for a loaded one.
BUDGET_S=${BUDGET_S:-480}
LORA_ESTIMATE_S=${LORA_ESTIMATE_S:-$([ "$DRY" = 1 ] && echo 60 || echo 150)}
MARGIN_S=45  # after the leg: timeout's 30 s before its KILL, and the verdict's imports

# ---- which sampler: vLLM where it is importable; the first line of the output says which
if [ "$DRY" = 1 ]; then
  SAMPLER=hf
  FIRST="gpu_check: --dry-run: checking the torchrun path with the HF sampler on the CPU (gloo, a 2-layer model)"
elif [ "${SAMPLER:-}" = hf ]; then
  FIRST="gpu_check: SAMPLER=hf: checking the torchrun path with the HF sampler"
elif "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  SAMPLER=vllm
  FIRST="gpu_check: checking the torchrun path with the vLLM sampler"
else
  SAMPLER=hf
  FIRST="gpu_check: vLLM is not installed here; checking the torchrun path with the HF sampler"
fi
# ---- the work folder, and room for it. Estimate for the 1.5B model (n = 1.54e9 parameters), not yet measured
# on a GPU: the random model in bf16 (2n bytes, 3.1 GB) and one checkpoint at a time (the HF folder's float32
# model 4n, and DCP's shards of the float32 model 4n and AdamW's two float32 moments 8n, the tied head once in
# each: 24.7 GB), 27.8 GB; 30 GB with room for logs and caches.
NEED_GB=$([ "$DRY" = 1 ] && echo 1 || echo 30)
SAVE_GB=$([ "$DRY" = 1 ] && echo 0.01 || echo 25)  # the checkpoint alone, for the disk-speed line
LR_STEP=1e-3
free_gb() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 {printf "%d", $4 * 1024 / 1e9}'; }
if [ $# -gt 0 ]; then
  WORK=$1
  mkdir -p "$WORK"
else  # the disk with the most room; /dev/shm (memory) only when no disk has enough
  BEST="" BEST_GB=-1
  for dir in "${TMPDIR:-}" /tmp "$(dirname "$PWD")" /var/tmp; do
    [ -n "$dir" ] && [ -d "$dir" ] && [ -w "$dir" ] || continue
    gb=$(free_gb "$dir"); [ -n "$gb" ] && [ "$gb" -gt "$BEST_GB" ] && { BEST=$dir; BEST_GB=$gb; }
  done
  if [ "$BEST_GB" -lt "$NEED_GB" ] && [ -w /dev/shm ] && [ "$(free_gb /dev/shm)" -ge "$NEED_GB" ]; then
    BEST=/dev/shm
  fi
  [ -n "$BEST" ] || { echo "gpu_check: no writable folder among \$TMPDIR, /tmp, $(dirname "$PWD"), /var/tmp: pass one" >&2; exit 1; }
  WORK=$(mktemp -d "$BEST/gpu_check.XXXXXX")
fi
rm -rf "$WORK"/run-* "$WORK"/lora "$WORK"/logs
mkdir -p "$WORK/logs"
# everything printed from here on is in logs/gpu_check.log too, the verdict last: one file brings it back
exec > >(tee "$WORK/logs/gpu_check.log") 2> >(tee -a "$WORK/logs/gpu_check.log" >&2)
echo "$FIRST"
echo "gpu_check: work folder $WORK"

# ---- what the check needs, one line each, before anything runs (tools/gpu_check.py: needs)
if [ "$DRY" = 1 ]; then
  SIZE=(--rollout-batch 2 --M 2 --max-tokens 8 --dtype float32 --eval-examples 2)
  PLAN_ARGS='{}'
else
  SIZE=(--rollout-batch 16 --M 8 --max-tokens 256 --micro-batch 16 --dtype bfloat16 --gpu-memory-utilization 0.3
        --eval-examples 16)
  PLAN_ARGS="{\"model\": \"Qwen/Qwen2.5-1.5B\", \"task\": \"arith\", \"M\": 8, \"rollout_batch\": 16,
              \"micro_batch\": 16, \"max_tokens\": 256, \"dtype\": \"bfloat16\", \"gpu_memory_utilization\": 0.3,
              \"beta\": 0.001}"
fi
NEEDS=(--sampler "$SAMPLER" --disk-need-gb "$NEED_GB" --run-args "$PLAN_ARGS" --save-gb "$SAVE_GB"
       --timeout "$RUN_TIMEOUT")
[ "$DRY" = 0 ] || NEEDS+=(--dry-run)
"$PY" -m tools.gpu_check "$WORK" --needs "${NEEDS[@]}" || { echo "gpu_check: stopped before the first run" >&2; exit 1; }
RUN_TIMEOUT=$(cat "$WORK/run_timeout_s")  # grown by the save's write time at the measured disk speed

"$PY" - "$WORK/model" "$DRY" <<'EOF' > "$WORK/model.log" 2>&1 || { cat "$WORK/model.log" >&2; exit 1; }
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

def name(i):  # letters, then one digit: the last integer of a random completion is its last token's digit, so
    word = ""  # arith's verifier pays about 1 sample in 10 where the answer is a digit, and the steps have a gradient
    for _ in range(4):
        i, letter = divmod(i, 26)
        word += string.ascii_lowercase[letter]
    return word


filler = [f"<{name(i // 10)}{i % 10}>" for i in range(vocab_size - len(special) - len(chars))]  # up to full size
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
[ ! -s "$WORK/model.log" ] || echo "gpu_check: $(tail -n 1 "$WORK/model.log")"  # empty: the model was there

GPUS=1  # --dry-run: one CPU process under torchrun (gloo)
[ "$DRY" = 1 ] || GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$QUICK" = 1 ] || [ "$DRY" = 1 ]; then DEFAULT_N=1; else DEFAULT_N=$(printf "1\n%s\n" "$GPUS" | sort -nu | xargs); fi
NPROCS=${NPROCS:-$DEFAULT_N}
SAVE=$((STEPS - 1))  # the save run's last step saves; the resume runs the last step from it and saves nothing
COMMON=(--model "$WORK/model" --task arith --sampler "$SAMPLER" --grad-checkpointing --top-p 0.999
        --eval-every 2 --keep-checkpoints 1)
# The hook for the engine-against-trainer weight comparison: on at every sync where this train.py has the flag
# (its failure is train.py's one line naming the parameter family, which the verdict quotes).
WEIGHT_CHECK=() VERDICT=()
HELP=$("$PY" train.py --help 2>/dev/null || true)
if [[ $HELP == *--weight-check-every* ]]; then WEIGHT_CHECK=(--weight-check-every 1) VERDICT=(--weight-check); fi
[ "$DRY" = 0 ] || VERDICT+=(--dry-run)

# what the check wrote in the work folder (model, logs, run folders), sampled each second and before each N's
# cleanup, while its checkpoint is still there: the disk gate holds the peak against NEED_GB
disk_sample() {
  { du -sck "$WORK"/model "$WORK"/logs "$WORK"/run-* "$WORK"/lora 2>/dev/null || true; } |
    awk 'END {print $1}' >> "$WORK/disk_kb"
}
( while sleep 1; do disk_sample; done ) > /dev/null 2>&1 &
DISK_WATCH=$!
trap 'kill "$DISK_WATCH" 2>/dev/null || true' EXIT

launch() {  # NAME TIMEOUT ARGS...: one torchrun under its timeout; output, then its exit status, to logs/NAME.log
  local name=$1 limit=$2; shift 2
  local code=0 start=$SECONDS
  timeout -k 30 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1 || code=$?
  echo "gpu_check: exit $code after $((SECONDS - start)) s (timeout $limit s)" >> "$WORK/logs/$name.log"
  [ "$code" = 0 ] || { echo "   $name: exit $code, the end of $WORK/logs/$name.log:"; tail -n 5 "$WORK/logs/$name.log"; }
  return 0
}

for N in $NPROCS; do
  echo "== torchrun --nproc_per_node $N: $SAMPLER sampler, one per rank; logs in $WORK/logs (timeout ${RUN_TIMEOUT} s each)"
  MORE=("${SIZE[@]}")
  MORE[1]=$((SIZE[1] * N))  # --rollout-batch: the same prompts per rank at every N
  TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$N" train.py "${COMMON[@]}" "${MORE[@]}"
            "${WEIGHT_CHECK[@]}")
  launch "run-$N-save" "$RUN_TIMEOUT" "${TORCHRUN[@]}" --lr 1e-6 --steps "$SAVE" --out-dir "$WORK/run-$N"
  if [[ $(tail -n 1 "$WORK/logs/run-$N-save.log") == "gpu_check: exit 0 "* ]]; then  # from its checkpoint,
    launch "run-$N-resume" "$RUN_TIMEOUT" "${TORCHRUN[@]}" --lr "$LR_STEP" --steps "$STEPS" \
      --resume "$WORK/run-$N" --no-final-save  # one more step at a large lr
  fi
  disk_sample  # the peak: the model and this N's checkpoint, before the cleanup
  { ls -A "$WORK/run-$N" 2>/dev/null || true; } | { grep checkpoint || true; } > "$WORK/logs/run-$N-checkpoints"
  rm -rf "$WORK/run-$N"/checkpoint-* "$WORK/run-$N"/.tmp-checkpoint-*  # read: no N leaves one for the next
done

# ---- the LoRA leg: one rank, peft's adapters on the same random model in the same dtype, FSDP2 (NCCL on a GPU)
LORA=("$PY" -m torch.distributed.run --standalone --nproc_per_node 1 train.py "${COMMON[@]}" "${SIZE[@]}"
      --eval-examples 0  # no evaluation: the leg checks the adapters' sync, and its time is the clock's
      --lora-rank 16 --beta 0.001  # beta > 0: the reference is the base, the policy with its adapters off
      --top-k 20 --min-p 0.05 --weight-check-every 1  # the merged weights against the engine's at each sync
      --lr "$LR_STEP" --warmup-steps 0  # every step at the large lr: the merged weights move at each sync
      --entropy-coef 0.01  # a gradient at every step: a random model's groups mostly share one reward, and
      --steps "$STEPS" --no-final-save --out-dir "$WORK/lora")  # the adapters' B starts at 0: else none moves
LORA_TIMEOUT=$RUN_TIMEOUT SKIP=""
if [ "$QUICK" = 1 ] || [ "$DRY" = 1 ]; then  # the clock: the leg runs only in what the budget has left
  LEFT=$((BUDGET_S - SECONDS - MARGIN_S))
  [ "$LEFT" -ge "$RUN_TIMEOUT" ] || LORA_TIMEOUT=$LEFT
  [ "$LEFT" -ge "$LORA_ESTIMATE_S" ] || SKIP="$SECONDS s of the $BUDGET_S s budget spent, and it takes about"
  SKIP=${SKIP:+"$SKIP $LORA_ESTIMATE_S s (BUDGET_S, LORA_ESTIMATE_S)"}
fi
if [ -n "$SKIP" ]; then
  echo "gpu_check: the LoRA leg SKIPPED: $SKIP" | tee "$WORK/logs/lora.log"  # the verdict reads it there
else
  echo "== the LoRA leg: torchrun --nproc_per_node 1, rank 16, $STEPS steps (timeout $LORA_TIMEOUT s)"
  launch lora "$LORA_TIMEOUT" "${LORA[@]}"
fi

kill "$DISK_WATCH" 2>/dev/null || true
sort -n "$WORK/disk_kb" | tail -n 1 | awk '{printf "%.3f\n", $1 * 1024 / 1e9}' > "$WORK/logs/disk_peak_gb"

# shellcheck disable=SC2086  # NPROCS: one argument per N
"$PY" -m tools.gpu_check "$WORK" --runs $NPROCS --sampler "$SAMPLER" --steps "$STEPS" --lr-step "$LR_STEP" \
  --timeout "$RUN_TIMEOUT" --run-args "$PLAN_ARGS" --disk-need-gb "$NEED_GB" --save-step "$SAVE" "${VERDICT[@]}" \
  --lora "$LORA_TIMEOUT"
