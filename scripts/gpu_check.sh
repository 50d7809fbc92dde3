#!/usr/bin/env bash
# What a user with GPUs runs first: train.py's headline path (colocated vLLM with sleep mode, FSDP2, weight
# sync and its check) on a randomly initialised Qwen2.5-1.5B-shaped model (28 layers, hidden 1536, vocab
# 151936, tied embeddings). Needs this repo's requirements and vLLM (requirements-vllm.txt); no network:
# the tokenizer is built in code.
#   1. one GPU, one process (vLLM's in-process engine): 4 steps; prints response tokens/s, MFU, the
#      trainer's peak GPU memory, the sampler-trainer log-prob difference and what sleep gave back;
#      and tools/memory_plan.py's planned peak against the measured one;
#   2. with 2 or more GPUs, the same through `torchrun --nproc_per_node <all GPUs>` (one engine per rank,
#      vLLM's external launcher): prints which GPU holds each rank's memory and fails if two ranks share
#      a GPU or if a rank's engine did not give its memory back on sleep.
#
#   bash scripts/gpu_check.sh [work_dir]          # default work dir: a fresh mktemp -d
#   bash scripts/gpu_check.sh --dry-run           # tiny model on the CPU (HF sampler, or vLLM if installed)
#
# MFU = model FLOPs per second / peak dense bf16 FLOP/s of the GPU (PEAK_TFLOPS overrides the table
# below), from train.py's perf/tflops: 2 FLOPs per parameter per token per forward pass (x3 with backward)
# for the sampler's, the reference's and the training passes; attention's quadratic term is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
WORK=${1:-$(mktemp -d)}
PY=${PYTHON:-python3}
STEPS=${STEPS:-4}
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
  GPUS=0
  SAMPLER=$("$PY" -c "import importlib.util as u; print('vllm' if u.find_spec('vllm') else 'hf')")
  SIZE=(--rollout-batch 2 --M 2 --max-tokens 8 --dtype float32)
else
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  [ "$GPUS" -ge 1 ] || { echo "gpu_check.sh: no GPU visible to torch (use --dry-run on a CPU)" >&2; exit 1; }
  SAMPLER=vllm
  SIZE=(--rollout-batch 16 --M 8 --max-tokens 256 --micro-batch 16 --dtype bfloat16 --gpu-memory-utilization 0.3)
fi
COMMON=(--model "$WORK/model" --task arith --sampler "$SAMPLER" --steps "$STEPS" --eval-examples 0 --lr 1e-6
        --save-every 0)

# Each run under a poller that records, twice a second, every training process's memory on every GPU.
watch_gpus() {  # watch_gpus OUT_CSV -- command...
  local out=$1; shift 2
  if [ "$GPUS" = 0 ]; then "$@"; return; fi
  "$PY" - "$out" <<'EOF' &
import subprocess, sys, time
with open(sys.argv[1], "w") as f:
    while True:  # pid, GPU index, MiB, the process's torchrun RANK
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=uuid,index", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout
        index = dict(line.split(", ") for line in gpus.strip().splitlines())
        for line in apps.strip().splitlines():
            pid, uuid, mib = line.split(", ")
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), "0")
            f.write(f"{pid},{index.get(uuid, uuid)},{mib},{rank}\n")
        f.flush()
        time.sleep(0.5)
EOF
  local poller=$!
  "$@" || { kill $poller; return 1; }
  kill $poller
}

echo "== 1 GPU, one process, $SAMPLER sampler"
watch_gpus "$WORK/mem-1.csv" -- "$PY" train.py "${COMMON[@]}" "${SIZE[@]}" --out-dir "$WORK/run-1"
RUNS=(1)
if [ "$GPUS" -ge 2 ]; then
  echo "== $GPUS GPUs, torchrun, one engine per rank"
  MORE=("${SIZE[@]}")
  MORE[1]=$((16 * GPUS))  # --rollout-batch: 16 prompts per rank
  watch_gpus "$WORK/mem-$GPUS.csv" -- "$PY" -m torch.distributed.run --nproc_per_node "$GPUS" train.py \
    "${COMMON[@]}" "${MORE[@]}" --out-dir "$WORK/run-$GPUS"
  RUNS+=("$GPUS")
fi

"$PY" - "$WORK" "$GPUS" "${RUNS[@]}" <<'EOF'
import collections, json, os, sys

work, gpus, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
failures = []
name, peak = "cpu", 0.0
if gpus:
    import torch
    name = torch.cuda.get_device_name(0)
    peaks = {"H200": 989, "H100": 989, "H800": 989, "A100": 312, "A800": 312, "L40S": 362, "L4": 121, "A10": 125}
    peak = float(os.environ.get("PEAK_TFLOPS") or next((v for k, v in peaks.items() if k in name), 0))
for ranks in runs:
    rows = [json.loads(line) for line in open(f"{work}/run-{ranks}/metrics.jsonl")]
    steady = rows[1:] or rows  # the first step pays for allocator warmup and kernel selection
    mean = lambda key: sum(r[key] for r in steady) / len(steady)
    print(f"-- {ranks} rank(s) on {name}; steps measured: {len(steady)} of {len(rows)}")
    print(f"step time {mean('time/step'):.2f} s (rollout {mean('time/rollout'):.2f}, train {mean('time/train'):.2f}, "
          f"weight sync + check {mean('time/sync'):.2f}); response length {mean('response/len_mean'):.0f} tokens")
    print(f"response tokens/s (sampled, scored and trained): {mean('perf/tokens_per_s'):.0f}")
    print(f"model TFLOP/s: {mean('perf/tflops'):.1f}" + (f"; MFU {100 * mean('perf/tflops') / (peak * int(ranks)):.1f}% "
          f"of {peak:.0f} TFLOP/s bf16 dense per GPU" if peak else " (unknown peak: set PEAK_TFLOPS for MFU)"))
    print(f"sampler-trainer log-prob difference: probe max {max(r['sync/logprob_diff'] for r in rows):.2e}, "
          f"rollout mean {mean('sync/rollout_logprob_diff'):.2e}")
    if not gpus:
        continue
    for r in range(int(ranks)):
        freed = min(row[f"mem/sleep_freed_gb/rank{r}"] for row in rows)
        trainer = max(row[f"mem/trainer_peak_gb/rank{r}"] for row in rows)
        print(f"rank {r}: trainer peak {trainer:.1f} GB (torch allocator); sleep gave back >= {freed:.1f} GB")
        if freed < 0.5 * 0.3 * torch.cuda.get_device_properties(r).total_memory / 1e9:  # --gpu-memory-utilization 0.3
            failures.append(f"{ranks}-rank run: rank {r}'s engine kept its memory through sleep ({freed:.1f} GB freed)")
    used = collections.defaultdict(float)  # (rank, gpu) -> peak GiB seen by nvidia-smi
    for line in open(f"{work}/mem-{ranks}.csv"):
        pid, gpu, mib, rank = line.strip().split(",")
        used[rank, gpu] = max(used[rank, gpu], float(mib) / 1024)
    # tools/memory_plan.py's per-rank peak for this run's settings, against what nvidia-smi saw: the first GPU
    # run calibrates the plan that the README's preset table rests on.
    from tools.memory_plan import GiB, plan
    run_args = dict(model=f"{work}/model", task="arith", M=8, rollout_batch=16 * int(ranks), micro_batch=16,
                    max_tokens=256, dtype="bfloat16", gpu_memory_utilization=0.3, beta=1e-3)
    planned = plan(run_args, gpus=int(ranks), gpu_gb=torch.cuda.get_device_properties(0).total_memory / GiB,
                   grad_checkpointing=False, prompt_tokens=128).peak / GiB
    holders = collections.defaultdict(list)
    for (rank, gpu), gb in sorted(used.items()):
        if gb > 1.0:  # a CUDA context alone is ~0.5 GiB
            holders[gpu].append(rank)
            print(f"rank {rank}: {gb:.1f} GiB peak on GPU {gpu} (nvidia-smi); tools/memory_plan.py planned {planned:.1f} GiB "
                  f"({100 * (planned - gb) / gb:+.0f}%)")
    for gpu, ranks_there in holders.items():
        if len(ranks_there) > 1:
            failures.append(f"{ranks}-rank run: ranks {', '.join(ranks_there)} share GPU {gpu}")
    if len({rank for rank, _ in used}) < int(ranks) or len(holders) < int(ranks):
        failures.append(f"{ranks}-rank run: {len(holders)} GPUs hold memory for {ranks} ranks")
for failure in failures:
    print(f"gpu_check.sh: FAIL: {failure}", file=sys.stderr)
sys.exit(1 if failures else 0)
EOF
