"""scripts/gpu_check.sh's report and verdict: reads the run folders and logs the script left in its work folder and
holds them against what a correct first GPU run must show. Each gate is a function of metric rows, so the tests
feed it rows that must fail (tests/test_gpu_check.py). docs/gpu.md explains every verdict line.

    python -m tools.gpu_check WORK --sampler hf --runs 1 8 --steps 4   # what gpu_check.sh runs at its end

The gates, one verdict line each (PASS, FAIL or skip, with why):
1. runs: every torchrun exited 0 within its timeout, and metrics.jsonl holds steps 1..STEPS after the resume.
   Any `train.py: error:` line of their logs is quoted (the sync check's and the weight check's one-line errors).
2. sync: the sampler-trainer probe difference stayed within train.py's tolerance at every step, the last one
   taken at the large learning rate, where a stale engine shows.
3. weights: train.py compared the engine's weights with the trainer's after every sync (--weight-check-every 1),
   where this train.py has the flag; a failure is train.py's one line naming the parameter family.
4. devices: no two ranks' engines on one device, as each engine reports its device (engine/device).
5. sleep: a sleeping vLLM engine gave back at least half of its --gpu-memory-utilization share of the device.
6. memory: the trainer's allocated peak per phase within 1.15 x tools/memory_plan.py's trainer_allocated.
7. disk: no checkpoint left in the work folder: each N's were deleted once it had resumed from them.
"""

import argparse
import glob
import json
import os
import re
import sys

MEMORY_SLACK = 1.15  # measured over planned before the memory gate fails: the plan is arithmetic, not a measurement
PHASES = ("rollout", "train", "sync")
PEAK_TFLOPS = {"H200": 989, "H100": 989, "H800": 989, "A100": 312, "A800": 312, "L40S": 362, "L4": 121, "A10": 125}


def read_rows(run_dir: str) -> list[dict]:
    """metrics.jsonl of a run folder ([] when there is none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_gate(rows: list[dict], steps: int, exits: dict, errors: list[str], timeout_s: int) -> tuple[str, str]:
    """Both launches exited 0 and the log holds steps 1..steps. `exits`: launch name -> exit status (None: not
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
    return "PASS", f"{steps} steps, the last one resumed from a checkpoint"


def sync_gate(rows: list[dict], tolerance: float, lr_step: float) -> tuple[str, str]:
    """Every step's probe difference (rank-maximum) within `tolerance`; the last step's reported apart: it was
    taken at learning rate `lr_step`, where an engine that missed part of the update disagrees visibly."""
    diffs = [r["sync/logprob_diff"] for r in rows if "sync/logprob_diff" in r]
    if not diffs:
        return "FAIL", "no sync/logprob_diff in metrics.jsonl"
    worst = max(diffs)
    detail = (f"probe difference max {worst:.2e} nats (tolerance {tolerance:g}); after the lr {lr_step:g} step "
              f"{diffs[-1]:.2e}")
    return ("FAIL" if worst > tolerance else "PASS"), detail


def weight_gate(enabled: bool, rows: list[dict], errors: list[str], runs_ok: bool) -> tuple[str, str]:
    """train.py's engine-against-trainer weight comparison after every sync, when this train.py has it: its
    one-line error names the family the engine missed; a run that passed logs sync/weight_diff at each step."""
    if not enabled:
        return "skip", "this train.py has no --weight-check-every: the engine's weights were not compared"
    family = [e for e in errors if "engine's" in e or "weight" in e.lower()]
    if family or not runs_ok:
        return "FAIL", family[0] if family else "a run stopped before its syncs were all checked"
    diffs = [r["sync/weight_diff"] for r in rows if "sync/weight_diff" in r]
    if len(diffs) < len(rows) or not rows:
        return "FAIL", f"sync/weight_diff logged at {len(diffs)} of {len(rows)} steps: the check did not run at each"
    return "PASS", f"every family of the engine's weights equals the trainer's after every sync (largest relative " \
                   f"difference {max(diffs):.1e})"


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
            short.append(f"rank {r}'s sleep freed {awake - asleep:.1f} GB, under half of its engine's "
                         f"{share_gb:.1f} GB")
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


def disk_gate(work: str) -> tuple[str, str]:
    """No checkpoint of any N is left: gpu_check.sh deletes each N's once it has resumed from them."""
    left = sorted(glob.glob(os.path.join(work, "run-*", "checkpoint-*")) +
                  glob.glob(os.path.join(work, "run-*", ".tmp-checkpoint-*")))
    if left:
        return "FAIL", f"{len(left)} checkpoint folder(s) left, e.g. {left[0]}"
    peak = os.path.join(work, "logs", "disk_peak_gb")
    grew = f"; the work folder's filesystem grew by at most {float(open(peak).read()):.1f} GB (sampled each second)" \
        if os.path.exists(peak) else ""
    return "PASS", f"no checkpoint left{grew}"


def error_lines(work: str, ranks: str) -> list[str]:
    """The `train.py: error:` lines of one N's launch logs, each once, in order."""
    lines = []
    for path in sorted(glob.glob(os.path.join(work, "logs", f"run-{ranks}-*.log"))):
        with open(path, errors="replace") as f:
            for line in f:
                found = re.search(r"train\.py: error: .*", line)
                if found and found.group(0).strip() not in lines:
                    lines.append(found.group(0).strip())
    return lines


def exit_codes(work: str, ranks: str) -> dict:
    """launch name -> exit status of one N's launches (gpu_check.sh writes logs/run-N-NAME.rc)."""
    codes = {}
    for name in ("save", "resume"):
        path = os.path.join(work, "logs", f"run-{ranks}-{name}.rc")
        codes[name] = int(open(path).read().strip()) if os.path.exists(path) else None
    return codes


def report(rows: list[dict], ranks: int, device_name: str, peak_tflops: float):
    """Step time, throughput and MFU of the steps after the first (which pays for warmup)."""
    steady = rows[1:] or rows

    def mean(key):
        return sum(r[key] for r in steady) / len(steady)

    print(f"-- {ranks} rank(s) on {device_name}: steps measured {len(steady)} of {len(rows)}, the last one resumed")
    print(f"   step {mean('time/step'):.2f} s (rollout {mean('time/rollout'):.2f}, train {mean('time/train'):.2f}, "
          f"sync + check {mean('time/sync'):.2f}); {mean('response/len_mean'):.0f} tokens a response, "
          f"{mean('perf/tokens_per_s'):.0f} response tokens/s")
    mfu = (f"MFU {100 * mean('perf/tflops') / (peak_tflops * ranks):.1f}% of {peak_tflops:.0f} TFLOP/s bf16 dense "
           "per GPU" if peak_tflops else "MFU unknown: set PEAK_TFLOPS")
    scores = [round(r["eval/score"], 3) for r in rows if "eval/score" in r]
    print(f"   model {mean('perf/tflops'):.1f} TFLOP/s, {mfu}; held-out scores {scores}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work")
    parser.add_argument("--runs", nargs="+", required=True, help="the N of each torchrun --nproc_per_node N")
    parser.add_argument("--sampler", choices=("hf", "vllm"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU: no device, sleep or memory gate")
    parser.add_argument("--weight-check", action="store_true", help="train.py ran --weight-check-every 1")
    parser.add_argument("--lr-step", type=float, default=1e-4, help="the resumed step's learning rate")
    parser.add_argument("--timeout", type=int, default=0, help="each launch's timeout, s (for the verdict)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--run-args", default="{}", help="train.py's flags for the plan, as JSON")
    cli = parser.parse_args(argv)
    from config import SYNC_TOLERANCE

    device_name, total_gb, peak = "cpu", 0.0, 0.0
    if not cli.dry_run:
        import torch

        device_name = torch.cuda.get_device_name(0)
        total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
        peak = float(os.environ.get("PEAK_TFLOPS") or next((v for k, v in PEAK_TFLOPS.items() if k in device_name), 0))
    verdict = []  # (N, gate, status, detail)
    for ranks in cli.runs:
        n = int(ranks)
        rows = read_rows(os.path.join(cli.work, f"run-{ranks}"))
        exits, errors = exit_codes(cli.work, ranks), error_lines(cli.work, ranks)
        runs = run_gate(rows, cli.steps, exits, errors, cli.timeout)
        gates = {"runs": runs}
        if rows:
            report(rows, n, device_name, peak)
            gates["sync"] = sync_gate(rows, SYNC_TOLERANCE["float32" if cli.dry_run else "bfloat16"], cli.lr_step)
        else:
            gates["sync"] = ("FAIL", "no metrics")
        gates["weights"] = weight_gate(cli.weight_check, rows, errors, runs[0] == "PASS")
        if cli.dry_run or not rows:
            why = "the CPU has no devices to share or memory to plan" if cli.dry_run else "no metrics"
            gates.update({g: ("skip" if cli.dry_run else "FAIL", why) for g in ("devices", "sleep", "memory")})
        else:
            gates["devices"] = device_gate(rows, n)
            gates["sleep"] = sleep_gate(rows, n, cli.gpu_memory_utilization * total_gb) if cli.sampler == "vllm" \
                else ("skip", "the HF sampler's sleep frees its weights into torch's cache, which training reuses")
            gates["memory"] = memory_gate(rows, n, planned_gb(cli, n, total_gb), PHASES if cli.sampler == "vllm"
                                          else ("train",))
            if cli.sampler == "hf":  # the plan's rollout and sync phases are vLLM's; the HF sampler's are not planned
                status, detail = gates["memory"]
                gates["memory"] = (status, detail + " (rollout and sync not gated: the plan models vLLM's engine)")
        verdict += [(ranks, gate, *result) for gate, result in gates.items()]
    verdict.append(("all", "disk", *disk_gate(cli.work)))
    failed = [v for v in verdict if v[2] == "FAIL"]
    print(f"gpu_check verdict ({cli.sampler} sampler, N = {' '.join(cli.runs)}, {device_name}):")
    for ranks, gate, status, detail in verdict:
        where = f"N={ranks}" if ranks != "all" else "all"
        print(f"  {status:<4}  {gate:<7} {where:<5} {detail}")
    print("gpu_check: " + (f"FAILED ({len(failed)} of {len(verdict)} gates)" if failed else "ok"))
    return 1 if failed else 0


def planned_gb(cli, ranks: int, total_gb: float) -> dict:
    """tools/memory_plan.py's trainer_allocated for one N's run, under torchrun (FSDP2 even on one rank), in GB."""
    from tools.memory_plan import GiB, plan, trainer_allocated

    run_args = {**json.loads(cli.run_args), "rollout_batch": json.loads(cli.run_args)["rollout_batch"] * ranks}
    p = plan(run_args, gpus=ranks, gpu_gb=total_gb * 1e9 / GiB, grad_checkpointing=True, prompt_tokens=128,
             torchrun=True)
    return {phase: size / 1e9 for phase, size in trainer_allocated(p).items()}


if __name__ == "__main__":
    sys.exit(main())
