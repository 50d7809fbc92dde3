"""Checkpoints through torch.distributed.checkpoint under torchrun (FSDP2 over gloo on CPU): each rank saves and
loads its own shards, a resume on the same world size equals the straight run to the bit, and a checkpoint
reshards to another world size (2 -> 1, 1 -> 2) with every tensor as saved. tests/dist_checkpoint.py runs the jobs.

    python -m pytest tests/test_dcp.py -q
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "dist_checkpoint.py")


def launch(world, *job):
    head = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        if world == 2
        else [sys.executable]
    )
    result = subprocess.run([*head, JOB, *map(str, job)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def comparable(path):
    with open(path) as f:
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/", "mem/"))} for line in f
        ]


def assert_equal_states(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_equal_states(a[key], b[key])
        else:
            assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key], key


@pytest.mark.slow
def test_dcp_resume_is_exact_on_2_ranks_and_reshards_2_to_1_and_1_to_2(tiny_model_dir, tmp_path):
    straight, split, single = tmp_path / "straight", tmp_path / "split", tmp_path / "single"
    launch(2, "train", straight, tiny_model_dir, 3)
    launch(2, "train", split, tiny_model_dir, 2)
    launch(1, "train", single, tiny_model_dir, 2)  # saved on 1 rank, for the 1 -> 2 reshard below
    ckpt = split / "checkpoint-000002"
    assert sorted(f for f in os.listdir(ckpt / "trainer") if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for world in (1, 2):  # each checkpoint, resumed on 1 and on 2 ranks: every tensor as saved
        launch(
            world,
            "load",
            tiny_model_dir,
            ckpt,
            tmp_path / f"2to{world}.pt",
            single / "checkpoint-000002",
            tmp_path / f"1to{world}.pt",
        )
    two_to_one, two_to_two = (torch.load(tmp_path / f"2to{world}.pt") for world in (1, 2))
    assert two_to_one["step"] == two_to_two["step"] == 2
    assert_equal_states(two_to_one, two_to_two)
    hf = load_file(ckpt / "model.safetensors")  # the HF folder's weights, the tied head once
    assert "lm_head.weight" not in hf and torch.equal(
        two_to_one["model"].pop("lm_head.weight"), hf["model.embed_tokens.weight"]
    )
    assert_equal_states(two_to_one["model"], hf)
    assert "model.lm_head.weight" not in dcp.FileSystemReader(str(ckpt / "trainer")).read_metadata().state_dict_metadata
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert not torch.equal(two_to_one["reference"]["model.norm.weight"], initial["model.norm.weight"])  # EMA moved
    assert all(len(moments) == 3 for moments in two_to_one["optimizer"].values())  # step, exp_avg, exp_avg_sq

    fork = tmp_path / "fork"  # the same checkpoint, continued on 1 rank: it trains on
    launch(1, "train", fork, tiny_model_dir, 3, ckpt)
    assert [r["step"] for r in comparable(fork / "metrics.jsonl")] == [3]
    shutil.rmtree(fork)
    launch(2, "train", split, tiny_model_dir, 3, split)  # resumed on 2 ranks: the straight run, to the bit
    assert comparable(split / "metrics.jsonl") == comparable(straight / "metrics.jsonl")
    assert_equal_states(
        load_file(split / "checkpoint-000003" / "model.safetensors"),
        load_file(straight / "checkpoint-000003" / "model.safetensors"),
    )

    assert_equal_states(torch.load(tmp_path / "1to1.pt"), torch.load(tmp_path / "1to2.pt"))
    launch(2, "train", single, tiny_model_dir, 3, single)
    assert [r["step"] for r in comparable(single / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_a_save_that_fails_on_one_rank_is_the_same_line_on_every_rank(tiny_model_dir, tmp_path):
    """Rank 1's disk fills while it writes its shard: no rank hangs, each raises the same one line, and the
    temporary folder goes while the last good checkpoint stays."""
    result = launch(2, "fail", tmp_path, tiny_model_dir)
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2 and lines[0].removeprefix("rank 0: ") == lines[1].removeprefix("rank 1: "), lines
    assert "No space left on device" in lines[0] and "checkpoint-000001, is intact" in lines[0]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000001"]


@pytest.mark.slow
def test_ranks_that_do_not_share_the_run_folder_stop_at_the_save_in_one_line(tiny_model_dir, tmp_path):
    """Two nodes' local disks at one path, played by one folder per rank: rank 1 cannot see rank 0's temporary
    folder, so no rank writes its shards, and each raises the line that names the shared path it needs."""
    result = launch(2, "unshared", tmp_path, tiny_model_dir)
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2 and lines[0].removeprefix("rank 0: ") == lines[1].removeprefix("rank 1: "), lines
    assert "rank 1 on" in lines[0] and "a filesystem that every node shares" in lines[0]
    assert not [f for rank in (0, 1) for f in os.listdir(tmp_path / f"rank{rank}") if f != ".lock"]


@pytest.mark.slow
def test_at_start_rank_0_alone_holds_the_whole_model_and_the_other_ranks_their_shards(tmp_path):
    """train.py's start on a 26M-parameter model saved in bf16 (policy and reference loaded in float32, about 200
    MB together). In one process the load holds both whole. On 2 ranks rank 0 alone reads them (its peak: the one
    process's, give or take FSDP2's copies of its shards), and rank 1 builds them empty and receives its shards:
    its peak stays well under a whole copy. Before, every rank loaded both whole (314 MB on each rank here)."""
    model_dir = tmp_path / "model"
    launch(1, "model", model_dir, 512, 8, "bfloat16")
    weights_mb = 2 * 2 * os.path.getsize(model_dir / "model.safetensors") / 2**20  # policy + reference, float32

    def peaks(world):
        out = launch(world, "measure-load", model_dir).stdout
        return {
            row["rank"]: row["peak_over_start_mb"]
            for row in (json.loads(line[len("measure ") :]) for line in out.splitlines() if line.startswith("measure "))
        }

    one, two = peaks(1)[0], peaks(2)
    assert one > 0.8 * weights_mb, (one, weights_mb)  # the measurement sees the load
    assert sorted(two) == [0, 1] and two[0] < 1.3 * one, (one, two)
    assert two[1] < 0.7 * one, (one, two)  # its halves of both models, never a whole one
