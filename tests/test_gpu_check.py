"""scripts/gpu_check.sh and its verdict (tools/gpu_check.py) without a GPU: the --dry-run of the no-vLLM path on
the CPU, each gate fed rows that must fail, and the per-rank memory record with CUDA's counters faked.

    python -m pytest tests/test_gpu_check.py -q
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from dist_train import DigitTask

import tasks
import train
from tools import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows_for(ranks: int, steps: int = 4, **per_rank) -> list[dict]:
    """Metric rows of a healthy `ranks`-rank GPU run; per_rank: name -> one value per rank, on every row."""
    base = {
        "time/step": 2.0,
        "time/rollout": 1.0,
        "time/train": 0.8,
        "time/sync": 0.2,
        "response/len_mean": 100,
        "perf/tokens_per_s": 500,
        "perf/tflops": 50.0,
        "sync/logprob_diff": 0.04,
    }
    healthy = {
        "engine/device": list(range(ranks)),
        "mem/device": list(range(ranks)),
        "mem/used_before_sleep_gb": [60.0] * ranks,
        "mem/used_after_sleep_gb": [20.0] * ranks,
        **{f"mem/peak_gb/{p}": [10.0] * ranks for p in gpu_check.PHASES},
        **per_rank,
    }
    return [
        {
            "step": s,
            **base,
            "lr": 1e-4 if s == steps else 1e-6,  # the last step resumed at a large lr
            "sync/sampler_moved": 0.3 if s == steps else 2e-4,
            **{f"{k}/rank{r}": v[r] for k, v in healthy.items() for r in range(ranks)},
        }
        for s in range(1, steps + 1)
    ]


def exited(code: int) -> str:
    """The last line gpu_check.sh's launch appends to a torchrun's log."""
    return f"gpu_check: exit {code} after 12 s (timeout 240 s)\n"


# gpu_check.sh's run args on Qwen2.5-1.5B (train.py's flags), as --needs reads them
NEEDS_RUN_ARGS = {
    "model": "Qwen/Qwen2.5-1.5B",
    "task": "arith",
    "M": 8,
    "rollout_batch": 16,
    "micro_batch": 16,
    "max_tokens": 256,
    "dtype": "bfloat16",
    "gpu_memory_utilization": 0.3,
    "beta": 0.001,
}


def test_the_device_gate_fails_when_two_ranks_engines_share_a_device_and_passes_when_they_do_not():
    assert gpu_check.device_gate(rows_for(2), 2)[0] == "PASS"
    status, detail = gpu_check.device_gate(rows_for(2, **{"engine/device": [0, 0]}), 2)
    assert status == "FAIL" and "ranks [0, 1] share cuda:0" in detail
    # the trainers' own devices differ (LOCAL_RANK): the gate reads the engines', not those
    assert gpu_check.device_gate(rows_for(2, **{"engine/device": [3, 3], "mem/device": [0, 1]}), 2)[0] == "FAIL"
    assert gpu_check.device_gate(rows_for(2, **{"engine/device": [0, -1]}), 2) == (
        "FAIL",
        "rank(s) [1]'s engine is not on a GPU",
    )
    old = [{k: v for k, v in row.items() if not k.startswith("engine/")} for row in rows_for(2)]
    assert gpu_check.device_gate(old, 2)[0] == "FAIL"  # a train.py that does not record it cannot pass


def test_the_memory_sleep_and_sync_gates_fail_past_their_bounds():
    plan = {"rollout": 10.0, "train": 10.0, "sync": 10.0}
    assert gpu_check.memory_gate(rows_for(2), 2, plan, gpu_check.PHASES)[0] == "PASS"
    status, detail = gpu_check.memory_gate(
        rows_for(2, **{"mem/peak_gb/train": [10.0, 11.6]}), 2, plan, gpu_check.PHASES
    )
    assert status == "FAIL" and "rank 1's train peak 11.6 GB > 1.15 x plan 10.0" in detail
    assert gpu_check.memory_gate(rows_for(2, **{"mem/peak_gb/sync": [30.0] * 2}), 2, plan, ("train",))[0] == "PASS"
    assert gpu_check.sleep_gate(rows_for(1), 1, share_gb=41.7)[0] == "PASS"  # freed 40 GB
    assert gpu_check.sleep_gate(rows_for(1, **{"mem/used_after_sleep_gb": [50.0]}), 1, share_gb=41.7)[0] == "FAIL"
    assert gpu_check.sync_gate(rows_for(1), 0.5, 1e-4)[0] == "PASS"
    stale = rows_for(1)
    stale[-1]["sync/logprob_diff"] = 0.9  # the large-lr step shows an engine that missed part of the update
    status, detail = gpu_check.sync_gate(stale, 0.5, 1e-4)
    assert status == "FAIL" and "after the lr 0.0001 step 9.00e-01" in detail
    small = rows_for(1)
    small[-1]["sync/sampler_moved"] = 0.03  # under the 0.04 the engine differs: a stale engine would look the same
    status, detail = gpu_check.sync_gate(small, 0.5, 1e-4)
    assert status == "FAIL" and detail.endswith("so a stale engine would pass; raise the lr step")


def test_runs_that_time_out_or_stop_fail_quoting_train_pys_line():
    ok = {"save": 0, "resume": 0}
    assert gpu_check.run_gate(rows_for(1), 4, ok, [], 240)[0] == "PASS"
    assert gpu_check.run_gate(rows_for(1, steps=3), 4, ok, [], 240)[0] == "FAIL"  # a step missing
    assert gpu_check.run_gate([], 4, {"save": 124, "resume": None}, [], 240) == (
        "FAIL",
        "the save run passed its timeout of 240 s",
    )
    assert gpu_check.run_gate(rows_for(1), 4, {"save": 0, "resume": None}, [], 240) == (
        "FAIL",
        "the resume run did not run",
    )
    line = "train.py: error: the engine's norms differ from the trainer's after the step-4 sync (model.norm.weight)"
    status, detail = gpu_check.run_gate(rows_for(1, steps=1), 4, {"save": 0, "resume": 1}, [line], 240)
    assert status == "FAIL" and detail.endswith(line)
    probe = "train.py: error: step 4: the sampler's log-probs differ from the trainer's by 0.9 nats"
    assert gpu_check.weight_gate(True, rows_for(1), [probe, line], runs_ok=False, tolerance=1e-10) == ("FAIL", line)
    assert gpu_check.weight_gate(False, rows_for(1), [], runs_ok=True, tolerance=1e-10)[0] == "skip"
    checked = [dict(row, **{"sync/weight_diff": 0.0}) for row in rows_for(1)]
    assert gpu_check.weight_gate(True, checked, [], runs_ok=True, tolerance=1e-10)[0] == "PASS"
    assert (
        gpu_check.weight_gate(True, checked[:1] + rows_for(1)[1:], [], runs_ok=True, tolerance=1e-10)[0] == "FAIL"
    )  # not each step
    checked[2]["sync/weight_diff"] = 1e-6  # logged, and over train.py's tolerance
    assert gpu_check.weight_gate(True, checked, [], True, 1e-10) == (
        "FAIL",
        "step 3: the largest relative difference 1.0e-06, over the tolerance 1e-10",
    )


def test_the_verdict_of_a_gpu_run_quotes_the_weight_checks_line(tmp_path, monkeypatch, capsys):
    """tools.gpu_check's whole verdict over a work folder as gpu_check.sh leaves it, CUDA's queries faked."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(total_memory=150e9))
    (tmp_path / "logs").mkdir()
    (tmp_path / "run-2").mkdir()
    rows = rows_for(2, **{"engine/device": [0, 0]})
    (tmp_path / "run-2" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = "train.py: error: the engine's norms differ from the trainer's after the step-4 sync (model.norm.weight)"
    (tmp_path / "logs" / "run-2-save.log").write_text(exited(0))
    (tmp_path / "logs" / "run-2-resume.log").write_text(f"noise\n[rank0]: {line}\n{line}\n" + exited(1))
    run_args = json.dumps(
        {
            "model": "Qwen/Qwen2.5-1.5B",
            "task": "arith",
            "M": 8,
            "rollout_batch": 16,
            "micro_batch": 16,
            "max_tokens": 256,
            "dtype": "bfloat16",
            "beta": 0.001,
        }
    )
    code = gpu_check.main(
        [str(tmp_path), "--runs", "2", "--sampler", "vllm", "--steps", "4", "--weight-check", "--run-args", run_args]
    )
    out = capsys.readouterr().out
    assert code == 1 and out.count(line) == 2  # in the runs line and the weights line, once each
    assert f"FAIL  weights N=2   {line}" in out and out.strip().endswith("gates)")


def test_the_verdict_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(total_memory=150e9))
    (tmp_path / "logs").mkdir()
    (tmp_path / "run-2").mkdir()
    (tmp_path / "run-2" / "checkpoint-000004").mkdir()  # one left behind: the disk gate fails
    rows = rows_for(2, **{"engine/device": [0, 0]})
    (tmp_path / "run-2" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("save", "resume"):
        (tmp_path / "logs" / f"run-2-{name}.log").write_text(exited(0))
    run_args = json.dumps(
        {
            "model": "Qwen/Qwen2.5-1.5B",
            "task": "arith",
            "M": 8,
            "rollout_batch": 16,
            "micro_batch": 16,
            "max_tokens": 256,
            "dtype": "bfloat16",
            "beta": 0.001,
        }
    )
    assert (
        gpu_check.main(
            [
                str(tmp_path),
                "--runs",
                "2",
                "--sampler",
                "hf",
                "--steps",
                "4",
                "--lr-step",
                "1e-4",
                "--run-args",
                run_args,
            ]
        )
        == 1
    )  # rows_for's resumed step is at 1e-4
    out = capsys.readouterr().out.splitlines()
    verdict = {
        line.split()[1]: line.split()[0]
        for line in out
        if line.startswith("  ") and len(line.split()) > 2 and line.split()[0] in ("PASS", "FAIL", "skip")
    }
    assert verdict == {
        "runs": "PASS",
        "sync": "PASS",
        "update": "PASS",
        "weights": "skip",
        "devices": "FAIL",
        "sleep": "skip",
        "memory": "PASS",
        "disk": "FAIL",
    }
    assert out[-1] == "gpu_check: FAILED (2 of 8 gates)"
    assert any("ranks [0, 1] share cuda:0" in line for line in out)
    assert any("rollout and sync not gated" in line for line in out)  # the HF sampler: the train phase only


def test_phase_memory_records_the_engines_device_and_what_an_hf_sampler_holds_asleep(tiny_model_dir, monkeypatch):
    """plumbing/run_log.Phases with CUDA's counters faked: engine/device is what the sampler reports, not the
    trainer's LOCAL_RANK device; an HF sampler's sleep frees its weights through torch, so the train phase's
    peak is not lowered by an engine that no longer holds them."""
    from plumbing.run_log import Phases
    from rollout import make_sampler

    assert make_sampler("hf", tiny_model_dir, dtype="float32").device() == torch.device("cpu")
    allocated = {"now": 1000, "peak": 1000}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50e9, 150e9))

    class Sampler:  # an HF-like sampler on cuda:0: 400 bytes of weights, all given back to torch when asleep
        def __init__(self):
            allocated["now"] += 400

        def device(self):
            return torch.device("cuda", 0)

        def sleep(self):
            allocated["now"] -= 400
            return 400

    phase = Phases(torch.device("cuda", 1))  # the trainer's own device: LOCAL_RANK 1
    sampler = phase.build(Sampler)
    phase.sleep(sampler)
    with phase("train"):
        allocated["peak"] = 3000  # the training peak, the sampler's weights gone
    values = phase.metrics()
    assert values["engine/device/rank0"] == 0 and values["mem/device/rank0"] == 1
    assert values["mem/engine_gb/rank0"] == 400 / 1e9
    assert values["mem/peak_gb/train/rank0"] == 3000 / 1e9  # nothing subtracted: the engine held nothing


@pytest.mark.slow
def test_the_dry_run_checks_the_no_vllm_path_and_leaves_no_checkpoint(tmp_path):
    """scripts/gpu_check.sh --dry-run: a random 2-layer model, train.py under torchrun --nproc_per_node 1 (gloo)
    with the HF sampler, checkpointing, top_p 0.999 and evaluation, a save, a resume from it for one more step at
    lr 1e-3, and the verdict. Every checkpoint is gone once read."""
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "STEPS": "3"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("gpu_check: --dry-run: checking the torchrun path with the HF sampler")
    assert lines[-1] == "gpu_check: ok"
    verdict = {  # gate -> status, the LoRA leg's gates as lora/GATE
        (line.split()[1] if line.split()[2] != "lora" else f"lora/{line.split()[1]}"): line.split()[0]
        for line in lines
        if line.split()[0] in ("PASS", "FAIL", "skip", "SKIPPED")
    }
    assert verdict["runs"] == verdict["sync"] == verdict["update"] == verdict["disk"] == "PASS"
    assert [verdict[f"lora/{gate}"] for gate in ("runs", "sync", "weights", "moved", "loss")] == ["PASS"] * 5
    assert sum(line.startswith("   step ") and "weight difference" in line for line in lines) == 3  # the leg's
    logs = sorted(os.listdir(tmp_path / "logs"))  # what one `tar -C WORK logs` brings back: at most 8 files
    assert len(logs) <= 8 and {"gpu_check.log", "lora.log", "run-1-save.log", "run-1-resume.log"} <= set(logs)
    assert (tmp_path / "logs" / "gpu_check.log").read_text().strip().endswith("gpu_check: ok")
    assert [n for n in os.listdir(tmp_path / "lora") if "checkpoint" in n] == []  # the leg saved nothing
    assert "compiler: none needed" in result.stdout and "disk: " in result.stdout  # what it needs, one line each
    assert "disk speed: " in result.stdout and int((tmp_path / "run_timeout_s").read_text()) >= 300
    assert verdict["devices"] == verdict["sleep"] == verdict["memory"] == "skip"
    import config  # the weight check runs after every sync where train.py has --weight-check-every

    has_flag = "weight_check_every" in {f.name for f in dataclasses.fields(config.Args)}
    assert verdict["weights"] == ("PASS" if has_flag else "skip")
    rows = [json.loads(line) for line in open(tmp_path / "run-1" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and "eval/score" in rows[1]  # --eval-every 2
    assert rows[-1]["lr"] == 1e-3 and rows[1]["lr"] == 1e-6  # the resumed step at the large learning rate
    assert "changed flags: --lr 1e-06 -> 0.001" in (tmp_path / "logs" / "run-1-resume.log").read_text()
    left = [name for name in os.listdir(tmp_path / "run-1") if "checkpoint" in name]
    assert left == []  # saved at step 2, resumed from, then deleted; the resumed run saved none
    assert (tmp_path / "logs" / "run-1-checkpoints").read_text().split() == ["checkpoint-000002"]


def test_a_run_without_matplotlib_ends_with_its_checkpoint_and_a_resume_with_no_final_save_saves_nothing(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """What the quick check needs of train.py: a machine with no plotting library finishes its save run (the
    curves are skipped in one line, after the final save), and the resumed run (--no-final-save) writes no
    checkpoint that nothing would read."""
    monkeypatch.setitem(tasks.TASKS, "digits", DigitTask())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.delitem(sys.modules, "tools.figures", raising=False)
    base = dict(
        task="digits",
        model=tiny_model_dir,
        M=4,
        rollout_batch=4,
        micro_batch=8,
        max_tokens=4,
        lr=3e-3,
        warmup_steps=0,
        eval_examples=0,
        dtype="float32",
        out_dir=str(tmp_path),
    )
    train.main(train.Args(**base, steps=1))
    out = capsys.readouterr().out
    assert "curves: skipped" in out and f"python -m tools.figures curves {tmp_path}" in out
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == [
        "checkpoint-000001",
        "completions.jsonl",
        "metrics.jsonl",
    ]  # saved, and no curves.png
    train.main(train.Args(**base, steps=2, resume=str(tmp_path), final_save=False))
    assert [n for n in os.listdir(tmp_path) if "checkpoint" in n] == ["checkpoint-000001"]  # the one it read
    assert [r["step"] for r in gpu_check.read_rows(str(tmp_path))] == [1, 2]
    train.main(train.Args(**base, steps=4, save_every=3, resume=str(tmp_path), final_save=False))
    assert sorted(n for n in os.listdir(tmp_path) if "checkpoint" in n) == [  # --save-every still saves
        "checkpoint-000001",
        "checkpoint-000003",
    ]


def test_the_update_gate_fails_when_the_large_step_moved_the_engine_no_more_than_a_small_one():
    assert gpu_check.update_gate(rows_for(1), 1e-4)[0] == "PASS"
    stale = rows_for(1)
    stale[-1]["sync/sampler_moved"] = 1e-4  # under the 2e-4 of a small-lr step
    status, detail = gpu_check.update_gate(stale, 1e-4)
    assert status == "FAIL" and detail.startswith("the engine did not take the update: ")
    stale[-1]["sync/sampler_moved"] = 0.0  # an engine that never moved
    assert gpu_check.update_gate(stale, 1e-4)[0] == "FAIL"
    old = [{k: v for k, v in row.items() if k != "sync/sampler_moved"} for row in rows_for(1)]
    assert gpu_check.update_gate(old, 1e-4)[0] == "FAIL"  # a train.py that does not record it cannot pass
    assert gpu_check.update_gate([], 1e-4) == ("FAIL", "no metrics")
    status, detail = gpu_check.update_gate(rows_for(1)[:-1], 1e-4)  # the save run's steps only
    assert status == "FAIL" and detail.endswith("the resume did not run its step")


def test_the_sampler_moved_measure_compares_the_tokens_both_probes_drew():
    from plumbing.sync import SyncProbe

    mask = torch.ones(2, 3)
    before = SyncProbe(
        [[1, 2, 3], [4, 5, 6]], torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]]), torch.zeros(2, 3), mask
    )
    assert before.sampler_moved(before) == 0.0  # the same engine draws the same tokens with the same log-probs
    now = SyncProbe(
        [[1, 2, 3], [4, 9, 6]], torch.tensor([[-1.0, -2.0, -3.5], [-1.25, -2.0, -1.0]]), torch.zeros(2, 3), mask
    )
    # row 0: all three tokens, 0.5 moved; row 1: up to its first new token (9), 0.25 + 1.0; 5 positions
    assert now.sampler_moved(before) == pytest.approx(1.75 / 5)


def disk_folder(tmp_path, peak_gb=None, held=("checkpoint-000002",), left=()):
    """A work folder as gpu_check.sh leaves it for the disk gate: the peak, each N's listing, what survived."""
    (tmp_path / "logs").mkdir(exist_ok=True)
    if peak_gb is not None:
        (tmp_path / "logs" / "disk_peak_gb").write_text(f"{peak_gb}\n")
    (tmp_path / "logs" / "run-1-checkpoints").write_text("".join(f"{name}\n" for name in held))
    for name in left:
        (tmp_path / "run-1" / name).mkdir(parents=True)
    return str(tmp_path)


@pytest.mark.parametrize(
    "peak, held, left, message",
    [
        (None, ("checkpoint-000002",), (), "no measurement of the work folder's size"),
        (23.4, ("checkpoint-000002",), (), "the work folder peaked at 23.4 GB, over the 23 GB the check asked for"),
        (
            21.6,
            ("checkpoint-000002", "checkpoint-000003"),
            (),
            "run-1 held checkpoint-000003 beside checkpoint-000002, which its resume read: a save nothing reads",
        ),
        (21.6, ("checkpoint-000002", ".tmp-checkpoint-000003"), (), "a save cut off"),
        (21.6, ("checkpoint-000002",), ("checkpoint-000002",), "1 checkpoint folder(s) left after the cleanup"),
    ],
)
def test_the_disk_gate_fails_on_a_peak_over_the_plan_or_a_checkpoint_nothing_reads(tmp_path, peak, held, left, message):
    status, detail = gpu_check.disk_gate(disk_folder(tmp_path, peak, held, left), ["1"], 23, 2)
    assert status == "FAIL" and message in detail


def test_the_disk_gate_passes_a_peak_within_the_plan_and_only_the_checkpoint_read(tmp_path):
    status, detail = gpu_check.disk_gate(disk_folder(tmp_path, 21.6), ["1"], 23, 2)
    assert status == "PASS" and "peaked at 21.60 GB of the 23 GB" in detail
    assert gpu_check.disk_gate(disk_folder(tmp_path, 21.6, held=()), ["1"], 23, 2)[0] == "PASS"  # save run failed


def test_needs_names_each_missing_thing_in_one_line(tmp_path, monkeypatch):
    """tools.gpu_check --needs: the HF path needs no compiler; vLLM's does; a missing package, too little disk or
    too little GPU memory each fail their own line."""
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)  # no cc, no gcc
    found = gpu_check.needs("hf", True, str(tmp_path), 1, {})
    assert all(ok for ok, _ in found) and "compiler: none needed" in found[2][1]
    lines = dict((line.split(":")[0], (ok, line)) for ok, line in gpu_check.needs("vllm", True, str(tmp_path), 1e9, {}))
    assert lines["compiler"][0] and not lines["disk"][0]  # --dry-run compiles nothing; 1e9 GB is not free
    assert lines["disk"][1].endswith("pass a work folder with more room")
    monkeypatch.setattr(gpu_check, "PACKAGES", (*gpu_check.PACKAGES, "no_such_package_here"))
    monkeypatch.setattr(gpu_check, "gpu_memory_need", lambda run_args: (True, "GPU memory: faked"))
    lines = dict((line.split(":")[0], (ok, line)) for ok, line in gpu_check.needs("vllm", False, str(tmp_path), 1, {}))
    assert not lines["packages"][0] and "no_such_package_here" in lines["packages"][1]
    assert not lines["compiler"][0] and "no cc or gcc on PATH" in lines["compiler"][1]
    assert "requirements-vllm.txt" in lines["packages"][1]
    monkeypatch.setattr(gpu_check, "PACKAGES", ())
    monkeypatch.setitem(gpu_check.importlib.util.__dict__, "find_spec", lambda name: object())  # "vllm is here"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    lines = dict((line.split(":")[0], (ok, line)) for ok, line in gpu_check.needs("vllm", False, str(tmp_path), 1, {}))
    assert not lines["allocator"][0] and "expandable_segments:True" in lines["allocator"][1]


def test_needs_times_the_disk_and_grows_the_timeout_by_the_saves_write_time_or_stops(tmp_path):
    found = gpu_check.needs("hf", True, str(tmp_path), 1, {}, save_gb=0.001)
    ((ok, line),) = [(ok, line) for ok, line in found if line.startswith("disk speed:")]
    assert ok and os.listdir(tmp_path) == []  # the probe file is gone
    save_s = float(line.split("takes about ")[1].split(" s")[0])
    assert gpu_check.run_timeout(found, 240) == int(240 + 2 * save_s)
    slow = gpu_check.disk_speed_need(str(tmp_path), 1e9, 1)  # a petabyte checkpoint: no disk writes it in time
    assert not slow[0] and slow[1].endswith("s: pass a work folder on a faster disk")
    assert gpu_check.run_timeout([(True, "disk: 10 GB free")], 240) == 240  # no speed measured: as given


def test_needs_holds_each_gpus_free_memory_against_the_plans_peak(monkeypatch):
    run_args = dict(NEEDS_RUN_ARGS)
    free = {0: 140e9, 1: 10e9}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (free[i], 150e9))
    ok, line = gpu_check.gpu_memory_need(run_args)
    assert not ok and "too little on cuda:1 10.0 GB" in line
    free[1] = 140e9
    assert gpu_check.gpu_memory_need(run_args)[0]


def test_phases_take_each_phases_peak_less_what_a_sleeping_vllm_engine_keeps(monkeypatch):
    """A vLLM-like engine keeps its bytes allocated through torch across its sleep: each phase's peak (counted
    afresh from the phase's start, the engine's transient buffers in it) is torch's less those; the device memory
    used around the sleep and time/NAME per phase are recorded, the times once per step."""
    from plumbing.run_log import Phases

    allocated = {"now": 1000, "peak": 1000}

    def allocate(n):
        allocated["now"] += n
        allocated["peak"] = max(allocated["peak"], allocated["now"])

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: allocated.update(peak=allocated["now"])
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50e9, 150e9))

    class Sampler:  # 400 bytes, of which 100 are still counted by torch while asleep
        def __init__(self):
            allocate(400)

        def device(self):
            return torch.device("cuda", 0)

        def sleep(self):
            allocate(-300)

    phase = Phases(torch.device("cuda", 0))
    sampler = phase.build(Sampler)
    allocate(9000)  # a peak before the step: not any phase's
    allocate(-9000)
    with phase("rollout"):
        allocate(5000)  # the engine's activations
        allocate(-5000)
        phase.sleep(sampler)
    with phase("train"):
        allocate(300)
        allocate(-300)
    values = phase.metrics()
    assert values["mem/peak_gb/rollout/rank0"] == 6000 / 1e9  # 1400 + 5000, less the engine's 400
    assert values["mem/peak_gb/train/rank0"] == 1300 / 1e9  # 1100 + 300, less the 100 the sleeping engine holds
    assert values["mem/used_before_sleep_gb/rank0"] == values["mem/used_after_sleep_gb/rank0"] == 100.0
    assert {key for key in values if key.startswith("time/")} == {"time/rollout", "time/train"}
    assert not any(key.startswith("time/") for key in phase.metrics())


def test_the_vllm_engine_refuses_expandable_segments_in_one_line_before_it_loads(monkeypatch):
    """vLLM's sleep mode (its CuMem allocator) asserts on expandable segments: the engine refuses them first, in
    one line, on a GPU (the CPU has no sleep mode); no vLLM is needed to get there."""
    from plumbing.models import SamplingError
    from rollout import VLLMSampler, allocator_conf_error

    assert allocator_conf_error({}) is None
    assert allocator_conf_error({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is None
    assert allocator_conf_error({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}).startswith(
        "PYTORCH_ALLOC_CONF sets expandable_segments:True"
    )
    for name, value in {
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }.items():  # what the engine sets, restored after
        monkeypatch.setenv(name, os.environ.get(name, value))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SamplingError, match="^PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:True") as err:
        VLLMSampler("/no/such/model", dtype="bfloat16", max_model_len=64, seed=0, gpu_memory_utilization=0.3)
    assert "\n" not in str(err.value) and "--sampler vllm" in str(err.value)


@pytest.mark.parametrize(
    "name,peak",
    [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989)],
)
def test_an_h100_pcie_card_gets_its_own_peak_not_the_sxm_modules(name, peak):
    """Issue 64: any "H100" read 989 TFLOP/s, the SXM figure, so MFU read low by a quarter on a PCIe card."""
    assert gpu_check.peak_tflops(name) == peak and gpu_check.peak_tflops("Some Other GPU") == 0


def test_needs_plans_the_gpu_memory_line_for_the_sampler_that_runs(tmp_path, monkeypatch):
    """--needs --sampler hf: the GPU memory line's peak is the HF sampler's plan (its own weights and sampling
    memory), not one with vLLM's 0.3 share of the GPU, which run_args (train.py's flags) do not name."""
    from tools.memory_plan import plan

    run_args = dict(NEEDS_RUN_ARGS)
    monkeypatch.setattr(gpu_check, "PACKAGES", ())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (140e9, 150e9))
    kwargs = dict(gpus=1, gpu_gb=150e9 / 2**30, grad_checkpointing=True, prompt_tokens=128, torchrun=True)
    peaks = {s: plan({**run_args, "sampler": s}, **kwargs).peak / 1e9 for s in ("hf", "vllm")}
    assert f"{peaks['hf']:.1f}" != f"{peaks['vllm']:.1f}"  # else the line could not tell them apart
    (line,) = [line for _, line in gpu_check.needs("hf", False, str(tmp_path), 1, run_args) if "GPU memory" in line]
    assert f"the plan's peak for one rank is {peaks['hf']:.1f} GB" in line


def lora_folder(tmp_path, rows=None, code=0, log=""):
    """A work folder as gpu_check.sh leaves it after the LoRA leg: WORK/lora/metrics.jsonl and logs/lora.log."""
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "lora").mkdir(exist_ok=True)
    rows = rows_lora() if rows is None else rows
    (tmp_path / "lora" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "logs" / "lora.log").write_text(log + ("" if code is None else exited(code)))
    return str(tmp_path)


def rows_lora(steps: int = 3) -> list[dict]:
    """A healthy LoRA leg's rows: every step moved the engine, the KL to the base 0 at step 1 only."""
    return [
        {
            "step": s,
            "grad/norm": 0.5,
            "loss/pg": 0.01,
            "loss/kl": 0.0 if s == 1 else 1e-3 * s,
            "sync/logprob_diff": 0.04,
            "sync/sampler_moved": 0.2,
            "sync/weight_diff": 0.0,
            "mem/peak_gb/train/rank0": 12.0,
        }
        for s in range(1, steps + 1)
    ]


def lora_verdict(folder: str) -> dict:
    return gpu_check.lora_gates(folder, 3, 0.5, 1e-10, 240)


def test_the_lora_leg_passes_a_healthy_run_and_prints_each_steps_figures(tmp_path, capsys):
    gates = lora_verdict(lora_folder(tmp_path))
    assert {gate: status for gate, (status, _) in gates.items()} == dict.fromkeys(
        ("runs", "sync", "weights", "moved", "loss"), "PASS"
    )
    out = capsys.readouterr().out
    assert (
        "   step 2: grad norm 5.00e-01, sync difference 4.00e-02 nats, movement 2.00e-01 nats, weight difference "
        "0.0e+00, peak memory 12.0 GB" in out
    )


def bad(rows, step, **values):
    rows[step - 1].update(values)
    return rows


@pytest.mark.parametrize(
    "rows, code, gate, message",
    [
        (bad(rows_lora(), 2, **{"sync/weight_diff": 3e-4}), 0, "weights", "step 2: the largest relative difference"),
        (rows_lora(2), 0, "runs", "metrics.jsonl holds steps [1, 2], not 1..3"),  # a missing step
        (bad(rows_lora(), 3, **{"sync/sampler_moved": 0.0}), 0, "moved", "did not move after step(s) [3]"),
        (rows_lora(), 1, "runs", "the lora run exited 1: no train.py error line"),
        (rows_lora(), 124, "runs", "the lora run passed its timeout of 240 s"),
        (rows_lora(), None, "runs", "the lora run did not run"),
        (bad(rows_lora(), 2, **{"sync/logprob_diff": 0.9}), 0, "sync", "probe difference max 9.00e-01"),
        (bad(rows_lora(), 2, **{"sync/logprob_diff": math.nan}), 0, "sync", "a difference is not a number"),
        (bad(rows_lora(), 3, **{"loss/pg": math.inf}), 0, "loss", "step 3: loss/pg not finite"),
        (bad(rows_lora(), 2, **{"loss/kl": 0.0}), 0, "loss", "so the reference is not the base"),
    ],
)
def test_each_lora_gate_fails_on_crafted_metrics(tmp_path, rows, code, gate, message):
    status, detail = lora_verdict(lora_folder(tmp_path, rows, code))[gate]
    assert status == "FAIL" and message in detail


def test_the_lora_leg_quotes_train_pys_line_and_a_skipped_leg_reads_skipped_not_pass(tmp_path, capsys):
    line = "train.py: error: the engine's q/k/v differ from the trainer's after the step-2 sync (e.g. x)"
    gates = lora_verdict(lora_folder(tmp_path, rows_lora(1), 1, log=f"[rank0]: {line}\n"))
    assert gates["weights"] == ("FAIL", line) and gates["runs"][1].endswith(line)
    note = "gpu_check: the LoRA leg SKIPPED: 401 s of the 480 s budget spent, and it takes about 150 s\n"
    (tmp_path / "logs" / "lora.log").write_text(note)
    assert lora_verdict(str(tmp_path)) == {"leg": ("SKIPPED", note.split("SKIPPED: ")[1].strip())}
    (tmp_path / "run-1").mkdir()
    rows = [dict(r, **{"sync/logprob_diff": 1e-7, "sync/weight_diff": 0.0}) for r in rows_for(1, steps=3)]  # CPU's
    (tmp_path / "run-1" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("save", "resume"):
        (tmp_path / "logs" / f"run-1-{name}.log").write_text(exited(0))
    disk_folder(tmp_path, 0.01)
    code = gpu_check.main(
        [str(tmp_path), "--runs", "1", "--sampler", "hf", "--steps", "3", "--dry-run", "--lr-step", "1e-4"]
        + ["--lora", "240"]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[-1] == "gpu_check: ok (the LoRA leg SKIPPED)"
    assert any(line.startswith("  SKIPPED  leg     lora  401 s of the 480 s budget spent") for line in out)
