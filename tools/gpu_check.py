"""scripts/gpu_check.sh's report and verdict: reads the run folders and logs the script left in its work folder and
holds them against what a correct first GPU run must show. Each gate is a function of metric rows, so the tests
feed it rows that must fail (tests/test_gpu_check.py). docs/gpu.md explains every verdict line.

    python -m tools.gpu_check WORK --sampler hf --runs 1 8 --steps 4   # what gpu_check.sh runs at its end

The gates, one verdict line each (PASS, FAIL or skip, with why):
1. runs: every torchrun exited 0 within its timeout, and metrics.jsonl holds steps 1..STEPS after the resume.
   Any `train.py: error:` line of their logs is quoted (the sync check's and the weight check's one-line errors).
2. sync: the sampler-trainer probe difference (mean nats per probe token) stayed within train.py's tolerance at
   every step. It sees an engine that computes another policy (wrong weights, dtype or tokenizer) by more than the
   tolerance (0.5 nats in bf16, where a healthy engine differs by ~0.04). A missed step shows only as large as the
   step moved the probe, so the gate also asks that the last step, at the large lr, moved the engine's probe
   further than the engine differs from the trainer; else it FAILs, as unable to see a stale engine.
   update: the large-lr step moved the engine's probe log-probs (sync/sampler_moved) more than any small-lr step
   did. It sees an engine that took no update, or a much smaller one; not a partial one.
3. weights: train.py compared the engine's weights with the trainer's after every sync (--weight-check-every 1),
   where this train.py has the flag: a checksum per tensor, so it sees one stale or missing tensor in any family
   (embedding, lm_head, q/k/v, gate/up, norms); a failure is train.py's one line naming the family.
4. devices: no two ranks' engines on one device, as each engine reports its device (engine/device).
5. sleep: a sleeping vLLM engine gave back at least half of its --gpu-memory-utilization share of the device.
6. memory: the trainer's allocated peak in the train phase (less what the sleeping engine holds) within 1.15 x
   tools/memory_plan.py's trainer_allocated (docs/memory_plan.md says what the 15% covers). The rollout and sync
   peaks hold the engine's transient buffers too: printed, not gated.
7. disk: the work folder at its peak (sampled each second and before each N's cleanup) within what the check
   asked for before it ran, and no checkpoint but the one each resume read.
8. the LoRA leg (`--lora`), one launch of rank-16 adapters, a line per step (grad norm, sync difference,
   movement, weight difference, peak memory), then its gates: runs, sync and weights as above (no resume, no
   lr-step comparison); moved (the engine's probe moved at every step: the merged weights reached it); loss
   (every loss term and the grad norm finite, and the KL to the reference above 0 after the first step: the
   reference is the base through disable_adapter, not the moving policy). SKIPPED, not PASS, where the quick
   check's clock left no time for it (logs/lora.log says so).

Before the first run, `--needs` checks and names, one line each, what the check needs: packages, a compiler
(only where the path compiles), disk room, disk speed (the save run's timeout grows by twice the time its
checkpoint takes to write at the measured speed, or the check stops there) and GPU memory (`needs`).
"""

import argparse
import glob
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import time

MEMORY_SLACK = 1.15  # measured over planned before the memory gate fails (docs/memory_plan.md: what it covers)
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "tqdm")  # the torchrun path on arith
PHASES = ("rollout", "train", "sync")
# dense bf16 TFLOP/s by the name torch reports, the first match wins: an H100 PCIe card or an NVL one computes less
# than the SXM module its bare name would match (NVIDIA's H100 datasheet: 756 PCIe, 835 NVL, 989 SXM)
PEAK_TFLOPS = {
    "H100 PCIe": 756,
    "H100 NVL": 835,
    "H200 NVL": 835,
    "H200": 989,
    "H100": 989,
    "H800": 989,
    "A100": 312,
    "A800": 312,
    "L40S": 362,
    "L4": 121,
    "A10": 125,
}


def peak_tflops(device_name: str) -> float:
    """PEAK_TFLOPS' figure for `device_name` (torch.cuda.get_device_name), 0 for a card it does not know."""
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in device_name), 0)


def read_rows(run_dir: str) -> list[dict]:
    """metrics.jsonl of a run folder ([] when there is none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_gate(rows: list[dict], steps: int, exits: dict, errors: list[str], timeout_s: int) -> tuple[str, str]:
    """Every launch exited 0 and the log holds steps 1..steps. `exits`: launch name -> exit status (None: not
    run); `errors`: the train.py error lines of their logs."""
    for name, code in exits.items():
        if code is None:
            return "FAIL", f"the {name} run did not run"
        if code in (124, 137):
            return "FAIL", f"the {name} run passed its timeout of {timeout_s} s"
        if code != 0:
            reason = errors[0] if errors else "no train.py error line; see its log"
            return "FAIL", f"the {name} run exited {code}: {reason}"
    got = [r["step"] for r in rows]
    if got != list(range(1, steps + 1)):
        return "FAIL", f"metrics.jsonl holds steps {got}, not 1..{steps}"
    return "PASS", f"{steps} steps" + (", the last one resumed from a checkpoint" if "resume" in exits else "")


def sync_gate(rows: list[dict], tolerance: float, lr_step: float | None) -> tuple[str, str]:
    """Every step's probe difference (rank-maximum) finite and within `tolerance`, and the last step (at learning
    rate `lr_step`; None: no such step, as in the LoRA leg) moved the engine's probe further than the engine then
    differed from the trainer: else an engine that missed the step would differ by no more than this one does,
    and the gate could not tell them apart."""
    diffs = [r["sync/logprob_diff"] for r in rows if "sync/logprob_diff" in r]
    if len(diffs) < len(rows) or not diffs:
        return "FAIL", f"sync/logprob_diff logged at {len(diffs)} of {len(rows)} steps"
    worst, moved = max(diffs), rows[-1].get("sync/sampler_moved", 0.0)
    detail = f"probe difference max {worst:.2e} nats (tolerance {tolerance:g})"
    if lr_step is not None:
        detail += f"; after the lr {lr_step:g} step {diffs[-1]:.2e}, which moved the engine's probe {moved:.2e}"
    if not all(d <= tolerance for d in diffs):  # a NaN too, which max() may pass over
        return "FAIL", detail + ("" if worst > tolerance else ": a difference is not a number")
    if lr_step is None:
        return "PASS", detail
    if moved <= diffs[-1]:
        return "FAIL", f"{detail}: no further than the difference, so a stale engine would pass; raise the lr step"
    return "PASS", detail


def update_gate(rows: list[dict], lr_step: float) -> tuple[str, str]:
    """The steps at learning rate `lr_step` (the resumed one) moved the engine's probe log-probs (sync/sampler_moved,
    the least of the ranks') more than every smaller-lr step did: an engine that missed the update does not."""
    if not rows:
        return "FAIL", "no metrics"
    if any("sync/sampler_moved" not in r for r in rows):
        return (
            "FAIL",
            "metrics.jsonl has no sync/sampler_moved at some step: this train.py does not record how far "
            "the engine moved",
        )
    at_lr = [(r.get("lr", 0.0), r["sync/sampler_moved"]) for r in rows]
    large = [moved for lr, moved in at_lr if math.isclose(lr, lr_step)]
    small = [moved for lr, moved in at_lr if lr < lr_step and not math.isclose(lr, lr_step)]
    if not large or not small:
        return "FAIL", f"no step at lr {lr_step:g} and a smaller one to compare: the resume did not run its step"
    detail = (
        f"the engine's probe log-probs moved {min(large):.2e} nats after the lr {lr_step:g} step, "
        f"at most {max(small):.2e} after a smaller step"
    )
    if min(large) <= max(small):
        return "FAIL", f"the engine did not take the update: {detail}"
    return "PASS", detail


def weight_gate(enabled: bool, rows: list[dict], errors: list[str], runs_ok: bool, tolerance: float) -> tuple[str, str]:
    """train.py's engine-against-trainer weight comparison after every sync, when this train.py has it: its
    one-line error names the family the engine missed; a run that passed logs sync/weight_diff at each step,
    each within `tolerance` (train.py's, plumbing/sync.py: RELATIVE_TOLERANCE)."""
    if not enabled:
        return "skip", "this train.py has no --weight-check-every: the engine's weights were not compared"
    family = [e for e in errors if "engine's" in e or "weight" in e.lower()]
    if family or not runs_ok:
        return "FAIL", family[0] if family else "a run stopped before its syncs were all checked"
    diffs = [r["sync/weight_diff"] for r in rows if "sync/weight_diff" in r]
    if len(diffs) < len(rows) or not rows:
        return "FAIL", f"sync/weight_diff logged at {len(diffs)} of {len(rows)} steps: the check did not run at each"
    if over := [r for r in rows if not r["sync/weight_diff"] <= tolerance]:  # a NaN too
        step, diff = over[0]["step"], over[0]["sync/weight_diff"]
        return "FAIL", f"step {step}: the largest relative difference {diff:.1e}, over the tolerance {tolerance:g}"
    return (
        "PASS",
        f"every family of the engine's weights equals the trainer's after every sync (largest relative "
        f"difference {max(diffs):.1e})",
    )


def device_gate(rows: list[dict], ranks: int) -> tuple[str, str]:
    """Each rank's engine on a GPU of its own, as the engine reports it (engine/device/rankR: -1 off the GPU)."""
    if not rows:
        return "FAIL", "no metrics"
    last = rows[-1]
    devices = {}
    for r in range(ranks):
        key = f"engine/device/rank{r}"
        if key not in last:
            return "FAIL", f"metrics.jsonl has no {key}: this train.py does not record the engine's device"
        devices.setdefault(int(last[key]), []).append(r)
    if -1 in devices:
        return "FAIL", f"rank(s) {devices[-1]}'s engine is not on a GPU"
    shared = {d: rs for d, rs in devices.items() if len(rs) > 1}
    if shared:
        return "FAIL", "; ".join(f"ranks {rs} share cuda:{d}" for d, rs in shared.items())
    return "PASS", ", ".join(f"rank {rs[0]}: cuda:{d}" for d, rs in sorted(devices.items(), key=lambda x: x[1]))


def sleep_gate(rows: list[dict], ranks: int, share_gb: float) -> tuple[str, str]:
    """vLLM: each rank's sleep freed at least half of its engine's share (`share_gb`: utilization x device)."""
    short, freed = [], []
    for r in range(ranks):
        awake = max(row[f"mem/used_before_sleep_gb/rank{r}"] for row in rows)
        asleep = max(row[f"mem/used_after_sleep_gb/rank{r}"] for row in rows)
        freed.append(awake - asleep)
        if awake - asleep < 0.5 * share_gb:
            short.append(
                f"rank {r}'s sleep freed {awake - asleep:.1f} GB, under half of its engine's {share_gb:.1f} GB"
            )
    if short:
        return "FAIL", "; ".join(short)
    return "PASS", f"sleep freed {min(freed):.1f}-{max(freed):.1f} GB per rank (share {share_gb:.1f} GB)"


def memory_gate(rows: list[dict], ranks: int, planned_gb: dict, gated: tuple) -> tuple[str, str]:
    """Each rank's trainer peak (mem/peak_gb/PHASE/rankR, allocated, less the engine's) of each phase in `gated`
    within MEMORY_SLACK x planned_gb[phase] (tools/memory_plan.py: trainer_allocated, in GB)."""
    over, worst = [], {}
    for r in range(ranks):
        for phase in gated:
            gb = max(row[f"mem/peak_gb/{phase}/rank{r}"] for row in rows)
            worst[phase] = max(worst.get(phase, 0.0), gb)
            if gb > MEMORY_SLACK * planned_gb[phase]:
                over.append(f"rank {r}'s {phase} peak {gb:.1f} GB > {MEMORY_SLACK} x plan {planned_gb[phase]:.1f}")
    detail = ", ".join(f"{ph} {worst[ph]:.1f} GB (plan {planned_gb[ph]:.1f})" for ph in gated)
    return ("FAIL", "; ".join(over)) if over else ("PASS", f"trainer peaks {detail}")


def disk_gate(work: str, runs: list[str], need_gb: float, save_step: int) -> tuple[str, str]:
    """The work folder's peak size (gpu_check.sh: logs/disk_peak_gb, sampled each second and before each N's
    cleanup) within `need_gb`, the room the check asked for before it ran; each N held no checkpoint but the one
    its resume read (logs/run-N-checkpoints, listed before the cleanup); none is left now."""
    peak_path = os.path.join(work, "logs", "disk_peak_gb")
    if not os.path.exists(peak_path):
        return "FAIL", "no measurement of the work folder's size (logs/disk_peak_gb)"
    peak = float(open(peak_path).read())
    problems = (
        [f"the work folder peaked at {peak:.1f} GB, over the {need_gb:g} GB the check asked for"]
        if peak > need_gb
        else []
    )
    read = f"checkpoint-{save_step:06d}"
    for ranks in runs:
        listed = os.path.join(work, "logs", f"run-{ranks}-checkpoints")
        held = open(listed).read().split() if os.path.exists(listed) else []
        if extra := [name for name in held if name != read]:
            why = "a save cut off" if any(n.startswith(".tmp") for n in extra) else "a save nothing reads"
            problems.append(f"run-{ranks} held {', '.join(extra)} beside {read}, which its resume read: {why}")
    left = sorted(
        glob.glob(os.path.join(work, "*", "checkpoint-*"))  # each N's run folder and the LoRA leg's
        + glob.glob(os.path.join(work, "*", ".tmp-checkpoint-*"))
    )
    if left:
        problems.append(f"{len(left)} checkpoint folder(s) left after the cleanup, e.g. {left[0]}")
    if problems:
        return "FAIL", "; ".join(problems)
    return (
        "PASS",
        f"the work folder peaked at {peak:.2f} GB of the {need_gb:g} GB asked for; one checkpoint per N, "
        f"{read}, read by its resume; none left",
    )


def needs(
    sampler: str, dry: bool, work: str, need_gb: float, run_args: dict, save_gb: float = 0.0
) -> list[tuple[bool, str]]:
    """What the check needs before its first run, one (ok, line) each: the path's packages, a C compiler where
    the path compiles (vLLM's CUDA graphs and compiled kernels; the HF sampler's path compiles nothing), the work
    folder's free disk, and each GPU's free memory against the plan's peak for one rank."""
    wanted = PACKAGES + (("vllm",) if sampler == "vllm" else ())
    missing = []
    for name in wanted:
        if name == "vllm":  # found, not imported: the run imports it first thing, and that takes a while
            missing += [] if importlib.util.find_spec(name) else [name]
            continue
        try:  # imported, not only found: a broken install (torchvision beside a CPU torch) fails here, not later
            importlib.import_module(name)
        except ModuleNotFoundError:
            missing.append(name)
        except Exception as err:  # noqa: BLE001 - whatever stops the import is the line's news
            missing.append(f"{name} ({type(err).__name__})")
    found = [
        (
            not missing,
            f"packages: {', '.join(wanted)} importable"
            if not missing
            else f"packages: missing or broken: {', '.join(missing)} (pip install -r requirements.txt"
            + (" -r requirements-vllm.txt" if sampler == "vllm" else "")
            + ")",
        )
    ]
    plots = importlib.util.find_spec("matplotlib") is not None
    found.append((True, "plots: matplotlib " + ("importable" if plots else "missing: the run skips its curves")))
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if sampler == "vllm" and not dry:
        found.append(
            (
                compiler is not None,
                f"compiler: {compiler} (vLLM compiles kernels at run time)"
                if compiler
                else "compiler: no cc or gcc on PATH, and vLLM compiles kernels at run time (SAMPLER=hf "
                "checks the path that compiles nothing)",
            )
        )
    else:
        found.append((True, "compiler: none needed (the HF sampler's path compiles nothing)"))
    if sampler == "vllm" and not dry and not missing:  # vLLM's sleep mode asserts on expandable segments
        from rollout import allocator_conf_error

        error = allocator_conf_error(os.environ)
        found.append((error is None, f"allocator: {error}" if error else "allocator: no expandable segments"))
    free = shutil.disk_usage(work).free / 1e9
    found.append(
        (
            free >= need_gb,
            f"disk: {work} has {free:.0f} GB free, the check needs about {need_gb:g} GB"
            + ("" if free >= need_gb else ": pass a work folder with more room"),
        )
    )
    if save_gb:
        found.append(disk_speed_need(work, save_gb, 64 if dry else 1024))
    if dry:
        found.append((True, "GPU memory: none needed (--dry-run runs on the CPU)"))
    elif any(m.split()[0] == "torch" for m in missing):
        found.append((False, "GPU memory: not checked without torch"))
    else:
        found.append(gpu_memory_need({**run_args, "sampler": sampler}))  # the plan budgets the sampler that runs
    return found


MAX_SAVE_S = 1800  # a checkpoint that takes longer to write stops the check before its first run


def disk_speed_need(work: str, save_gb: float, probe_mb: int) -> tuple[bool, str]:
    """Write and fsync `probe_mb` MB in `work`: how long the save run's checkpoint (`save_gb`) takes at that speed."""
    path, block = os.path.join(work, ".disk-speed-probe"), os.urandom(1 << 20)
    start = time.perf_counter()
    try:
        with open(path, "wb") as f:
            for _ in range(probe_mb):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if os.path.exists(path):
            os.remove(path)
    speed = probe_mb / max(time.perf_counter() - start, 1e-6)  # MB/s
    save_s = save_gb * 1e3 / speed
    line = f"disk speed: {speed:.0f} MB/s in {work}: the save's {save_gb:g} GB checkpoint takes about {save_s:.0f} s"
    if save_s > MAX_SAVE_S:
        return False, line + f", over {MAX_SAVE_S} s: pass a work folder on a faster disk"
    return True, line


def run_timeout(found: list[tuple[bool, str]], base_s: int) -> int:
    """Each launch's timeout: `base_s` plus twice the save's write time from the disk-speed line."""
    line = next((line for _, line in found if line.startswith("disk speed:")), "")
    save_s = float(re.search(r"takes about (\d+) s", line).group(1)) if line else 0.0
    return int(base_s + 2 * save_s)


def gpu_memory_need(run_args: dict) -> tuple[bool, str]:
    """Each visible GPU's free memory against tools/memory_plan.py's peak for one rank (N = 1 holds the most)."""
    import torch

    from tools.memory_plan import plan

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return False, "GPU memory: no GPU visible to torch (use --dry-run on a CPU)"
    frees = [torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count())]  # (free, total) bytes
    total = min(t for _, t in frees)
    need = plan(
        {**run_args}, gpus=1, gpu_gb=total / 2**30, grad_checkpointing=True, prompt_tokens=128, torchrun=True
    ).peak
    short = [f"cuda:{i} {f / 1e9:.1f}" for i, (f, _) in enumerate(frees) if f < need]
    line = f"GPU memory: the plan's peak for one rank is {need / 1e9:.1f} GB; free " + ", ".join(
        f"cuda:{i} {f / 1e9:.1f} of {t / 1e9:.1f} GB" for i, (f, t) in enumerate(frees)
    )
    return not short, line + (
        f" - too little on {', '.join(short)} GB: free it, or pick others with CUDA_VISIBLE_DEVICES" if short else ""
    )


def error_lines(work: str, logs: str) -> list[str]:
    """The `train.py: error:` lines of the launch logs WORK/logs/`logs` (a glob), each once, in order."""
    lines = []
    for path in sorted(glob.glob(os.path.join(work, "logs", logs))):
        with open(path, errors="replace") as f:
            for line in f:
                found = re.search(r"train\.py: error: .*", line)
                if found and found.group(0).strip() not in lines:
                    lines.append(found.group(0).strip())
    return lines


def exit_code(work: str, name: str) -> int | None:
    """A launch's exit status, the last line of its log (gpu_check.sh: `gpu_check: exit CODE after ...`), None
    where it did not run."""
    path = os.path.join(work, "logs", f"{name}.log")
    lines = open(path, errors="replace").read().splitlines() if os.path.exists(path) else []
    found = re.match(r"gpu_check: exit (\d+) ", lines[-1]) if lines else None
    return int(found.group(1)) if found else None


def exit_codes(work: str, ranks: str) -> dict:
    """launch name -> exit status of one N's launches (logs/run-N-NAME.log)."""
    return {name: exit_code(work, f"run-{ranks}-{name}") for name in ("save", "resume")}


def moved_gate(rows: list[dict]) -> tuple[str, str]:
    """The engine's probe log-probs moved at every step (sync/sampler_moved > 0): every step's merged weights
    reached the engine. The LoRA leg's steps are all at the large lr, each with a gradient."""
    if not rows:
        return "FAIL", "no metrics"
    moved = [r.get("sync/sampler_moved", 0.0) for r in rows]
    if still := [r["step"] for r, m in zip(rows, moved) if not m > 0]:
        return "FAIL", f"the engine's probe did not move after step(s) {still}: the merged weights did not reach it"
    return "PASS", f"the engine's probe moved {min(moved):.2e}-{max(moved):.2e} nats a step"


def loss_gate(rows: list[dict]) -> tuple[str, str]:
    """Every loss term and the grad norm finite at every step, and the KL to the reference above 0 after the
    first: under LoRA the reference is the base (the adapters off, disable_adapter), which the adapters' first
    step leaves behind; a reference that were the policy itself would read 0 throughout."""
    if not rows:
        return "FAIL", "no metrics"
    for r in rows:
        if bad := [k for k, v in r.items() if k.startswith(("loss/", "grad/norm")) and not math.isfinite(v)]:
            return "FAIL", f"step {r['step']}: {', '.join(bad)} not finite"
    kl = [r.get("loss/kl", 0.0) for r in rows]
    if not all(k > 0 for k in kl[1:]):
        return "FAIL", f"the KL to the reference is {kl}: 0 after the first step, so the reference is not the base"
    return "PASS", f"the loss finite at every step; the KL to the base {', '.join(f'{k:.1e}' for k in kl)}"


def lora_report(rows: list[dict]):
    """The LoRA leg, one line a step: what issue 64 asks the quick check to print of it."""
    print(f"-- the LoRA leg: {len(rows)} step(s)")
    for r in rows:
        peaks = [v for k, v in r.items() if k.startswith("mem/peak_gb/") and k.endswith("/rank0")]
        print(
            f"   step {r['step']}: grad norm {r.get('grad/norm', math.nan):.2e}, sync difference "
            f"{r.get('sync/logprob_diff', math.nan):.2e} nats, movement {r.get('sync/sampler_moved', math.nan):.2e} "
            f"nats, weight difference {r.get('sync/weight_diff', math.nan):.1e}, peak memory "
            + (f"{max(peaks):.1f} GB" if peaks else "none recorded (CPU)")
        )


def lora_gates(work: str, steps: int, sync_tolerance: float, weight_tolerance: float, timeout_s: int) -> dict:
    """The LoRA leg's gates (gpu_check.sh's `lora` launch, folder WORK/lora), after its report; one SKIPPED line
    where logs/lora.log says the clock skipped it."""
    path = os.path.join(work, "logs", "lora.log")
    skipped = open(path).readline().strip() if os.path.exists(path) else ""
    if skipped.startswith("gpu_check: the LoRA leg SKIPPED: "):
        return {"leg": ("SKIPPED", skipped.removeprefix("gpu_check: the LoRA leg SKIPPED: "))}
    rows, errors = read_rows(os.path.join(work, "lora")), error_lines(work, "lora.log")
    runs = run_gate(rows, steps, {"lora": exit_code(work, "lora")}, errors, timeout_s)
    if rows:
        lora_report(rows)
    return {
        "runs": runs,
        "sync": sync_gate(rows, sync_tolerance, None) if rows else ("FAIL", "no metrics"),
        "weights": weight_gate(True, rows, errors, runs[0] == "PASS", weight_tolerance),
        "moved": moved_gate(rows),
        "loss": loss_gate(rows),
    }


def report(rows: list[dict], ranks: int, device_name: str, peak_tflops: float):
    """Step time, throughput and MFU of the steps after the first (which pays for warmup)."""
    steady = rows[1:] or rows

    def mean(key):
        return sum(r[key] for r in steady) / len(steady)

    print(f"-- {ranks} rank(s) on {device_name}: steps measured {len(steady)} of {len(rows)}, the last one resumed")
    print(
        f"   step {mean('time/step'):.2f} s (rollout {mean('time/rollout'):.2f}, train {mean('time/train'):.2f}, "
        f"sync + check {mean('time/sync'):.2f}); {mean('response/len_mean'):.0f} tokens a response, "
        f"{mean('perf/tokens_per_s'):.0f} response tokens/s"
    )
    mfu = (
        f"MFU {100 * mean('perf/tflops') / (peak_tflops * ranks):.1f}% of {peak_tflops:.0f} TFLOP/s bf16 dense per GPU"
        if peak_tflops
        else "MFU unknown: set PEAK_TFLOPS"
    )
    scores = [round(r["eval/score"], 3) for r in rows if "eval/score" in r]
    print(f"   model {mean('perf/tflops'):.1f} TFLOP/s, {mfu}; held-out scores {scores}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work")
    parser.add_argument("--needs", action="store_true", help="before the runs: check what the check needs, and exit")
    parser.add_argument("--runs", nargs="+", default=[], help="the N of each torchrun --nproc_per_node N")
    parser.add_argument("--sampler", choices=("hf", "vllm"), required=True)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument(
        "--save-step", type=int, default=0, help="the step of the checkpoint each resume read (default: steps - 1)"
    )
    parser.add_argument("--disk-need-gb", type=float, default=30.0, help="the room the check asked for")
    parser.add_argument("--dry-run", action="store_true", help="CPU: no device, sleep or memory gate")
    parser.add_argument("--weight-check", action="store_true", help="train.py ran --weight-check-every 1")
    parser.add_argument("--lr-step", type=float, default=1e-3, help="the resumed step's learning rate")
    parser.add_argument(
        "--timeout",
        type=int,
        default=0,
        help="each launch's timeout, s (with --needs: before the "
        "save's write time is added; it writes WORK/run_timeout_s)",
    )
    parser.add_argument("--save-gb", type=float, default=0.0, help="with --needs: the save run's checkpoint, GB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--run-args", default="{}", help="train.py's flags for the plan, as JSON")
    parser.add_argument("--lora", type=int, metavar="TIMEOUT", help="the LoRA leg ran (or was skipped) under TIMEOUT s")
    cli = parser.parse_args(argv)
    if cli.needs:
        found = needs(cli.sampler, cli.dry_run, cli.work, cli.disk_need_gb, json.loads(cli.run_args), cli.save_gb)
        for ok, line in found:
            print(f"gpu_check: {'' if ok else 'MISSING '}{line}")
        if cli.timeout:  # gpu_check.sh reads it back
            with open(os.path.join(cli.work, "run_timeout_s"), "w") as f:  # not a log: logs/ holds few files
                f.write(f"{run_timeout(found, cli.timeout)}\n")
        return 0 if all(ok for ok, _ in found) else 1
    if not cli.runs or cli.steps < 2:
        parser.error("the verdict needs --runs and --steps >= 2")
    from config import SYNC_TOLERANCE
    from plumbing.sync import RELATIVE_TOLERANCE

    device_name, total_gb, peak = "cpu", 0.0, 0.0
    if not cli.dry_run:
        import torch

        device_name = torch.cuda.get_device_name(0)
        total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
        peak = float(os.environ.get("PEAK_TFLOPS") or peak_tflops(device_name))
    sync_tolerance = SYNC_TOLERANCE["float32" if cli.dry_run else "bfloat16"]
    verdict = []  # (N, gate, status, detail)
    for ranks in cli.runs:
        n = int(ranks)
        rows = read_rows(os.path.join(cli.work, f"run-{ranks}"))
        exits, errors = exit_codes(cli.work, ranks), error_lines(cli.work, f"run-{ranks}-*.log")
        runs = run_gate(rows, cli.steps, exits, errors, cli.timeout)
        gates = {"runs": runs}
        if rows:
            report(rows, n, device_name, peak)
            gates["sync"] = sync_gate(rows, sync_tolerance, cli.lr_step)
        else:
            gates["sync"] = ("FAIL", "no metrics")
        gates["update"] = update_gate(rows, cli.lr_step)
        gates["weights"] = weight_gate(cli.weight_check, rows, errors, runs[0] == "PASS", RELATIVE_TOLERANCE)
        if cli.dry_run or not rows:
            why = "the CPU has no devices to share or memory to plan" if cli.dry_run else "no metrics"
            gates.update({g: ("skip" if cli.dry_run else "FAIL", why) for g in ("devices", "sleep", "memory")})
        else:
            gates["devices"] = device_gate(rows, n)
            gates["sleep"] = (
                sleep_gate(rows, n, cli.gpu_memory_utilization * total_gb)
                if cli.sampler == "vllm"
                else ("skip", "the HF sampler's sleep frees its weights into torch's cache, which training reuses")
            )
            status, detail = memory_gate(rows, n, planned_gb(cli, n, total_gb), ("train",))
            gates["memory"] = (
                status,
                detail + " (rollout and sync not gated: they hold the engine's transient buffers)",
            )
        verdict += [(ranks, gate, *result) for gate, result in gates.items()]
    if cli.lora is not None:
        lora = lora_gates(cli.work, cli.steps, sync_tolerance, RELATIVE_TOLERANCE, cli.lora)
        verdict += [("lora", gate, *result) for gate, result in lora.items()]
    verdict.append(("all", "disk", *disk_gate(cli.work, cli.runs, cli.disk_need_gb, cli.save_step or cli.steps - 1)))
    failed = [v for v in verdict if v[2] == "FAIL"]
    print(f"gpu_check verdict ({cli.sampler} sampler, N = {' '.join(cli.runs)}, {device_name}):")
    for ranks, gate, status, detail in verdict:
        where = ranks if ranks in ("all", "lora") else f"N={ranks}"
        print(f"  {status:<4}  {gate:<7} {where:<5} {detail}")
    skipped = " (the LoRA leg SKIPPED)" if any(v[2] == "SKIPPED" for v in verdict) else ""
    print("gpu_check: " + (f"FAILED ({len(failed)} of {len(verdict)} gates)" if failed else "ok") + skipped)
    return 1 if failed else 0


def planned_gb(cli, ranks: int, total_gb: float) -> dict:
    """tools/memory_plan.py's trainer_allocated for one N's run, under torchrun (FSDP2 even on one rank), in GB."""
    from tools.memory_plan import GiB, plan, trainer_allocated

    run_args = {**json.loads(cli.run_args), "rollout_batch": json.loads(cli.run_args)["rollout_batch"] * ranks}
    p = plan(
        run_args, gpus=ranks, gpu_gb=total_gb * 1e9 / GiB, grad_checkpointing=True, prompt_tokens=128, torchrun=True
    )
    return {phase: size / 1e9 for phase, size in trainer_allocated(p).items()}


if __name__ == "__main__":
    sys.exit(main())
