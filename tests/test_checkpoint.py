"""--keep-checkpoints K (plumbing/checkpoint.py: prune_checkpoints): which folders go, and that a pruned run still
resumes exactly and a failed save deletes nothing.

    python -m pytest tests/test_checkpoint.py -q
"""

import errno
import os

import pytest
import torch
from test_bad_input import fake_checkpoint, snapshot

from plumbing.checkpoint import find_checkpoint, prune_checkpoints


@pytest.fixture
def digits(monkeypatch):
    from dist_train import DigitTask

    import tasks

    monkeypatch.setitem(tasks.TASKS, "digits", DigitTask())


def checkpoints(run):
    return sorted(d for d in os.listdir(run) if d.startswith("checkpoint-"))


# ---- on fake folders (fast)

def test_prune_keeps_the_newest_complete_checkpoints_by_step_and_nothing_else(tmp_path):
    for step in (3, 999_999, 1_000_000, 7):  # by step, not by name: "checkpoint-1000000" sorts first as text
        fake_checkpoint(tmp_path, step, {"step": step})
    (fake_checkpoint(tmp_path, 2_000_000, {}) / "trainer_state.pt").unlink()  # not a checkpoint, however new
    (tmp_path / ".tmp-checkpoint-3000000-abc").mkdir()  # a save in flight or killed: remove_orphans' to clear
    (tmp_path / "checkpoint-notes").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    before = snapshot(tmp_path)

    assert prune_checkpoints(str(tmp_path), 2) == ["checkpoint-000003", "checkpoint-000007"]
    assert sorted(os.listdir(tmp_path)) == [".tmp-checkpoint-3000000-abc", "checkpoint-1000000", "checkpoint-2000000",
                                            "checkpoint-999999", "checkpoint-notes", "metrics.jsonl"]
    assert snapshot(tmp_path) == {k: v for k, v in before.items() if "checkpoint-00000" not in k}  # the rest as was
    assert prune_checkpoints(str(tmp_path), 2) == []  # already down to two
    assert prune_checkpoints(str(tmp_path), 1) == ["checkpoint-999999"]
    assert find_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1000000")  # the newest is never deleted


def test_prune_keep_0_more_than_there_are_or_another_rank_deletes_nothing(tmp_path, capsys):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step, {"step": step})
    before = snapshot(tmp_path)
    assert prune_checkpoints(str(tmp_path), 0) == []  # 0: keep all
    assert prune_checkpoints(str(tmp_path), 5) == []
    assert prune_checkpoints(str(tmp_path), 1, master=False) == []  # rank 0 alone deletes
    assert snapshot(tmp_path) == before and capsys.readouterr().out == ""
    assert prune_checkpoints(str(tmp_path / "no-such-run"), 1) == []
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 0"):
        prune_checkpoints(str(tmp_path), -1)


def test_a_prune_killed_mid_delete_leaves_no_checkpoint_that_looks_complete(tmp_path, monkeypatch):
    """The folder is renamed away before its files go: a kill inside rmtree leaves a .tmp-checkpoint-* folder
    (remove_orphans clears it), never a checkpoint-STEP that find_checkpoint would pick with files missing."""
    import shutil

    from plumbing import checkpoint

    for step in (1, 2):
        fake_checkpoint(tmp_path, step, {"step": step})

    class Killed(Exception):
        pass

    def killed(path, *args, **kwargs):  # rmtree's first file goes, then the process dies
        os.remove(os.path.join(path, "config.json"))
        raise Killed

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(Killed):
        prune_checkpoints(str(tmp_path), 1)
    monkeypatch.undo()
    left = sorted(os.listdir(tmp_path))
    assert left[0].startswith(".tmp-checkpoint-000001-") and left[1:] == ["checkpoint-000002"]
    assert find_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-000002")
    assert checkpoint.remove_orphans(str(tmp_path)) == left[:1]  # the next start clears it
    assert os.listdir(tmp_path) == ["checkpoint-000002"]


# ---- through train.main on the tiny model

def test_pruned_runs_resume_exactly_and_a_failed_save_deletes_nothing(tiny_model_dir, tmp_path, digits, monkeypatch):
    """A straight 4-step run against one whose 3rd save fails on a full disk (keep 1: checkpoint-2 alone is left,
    untouched), resumed from there to step 4 (keep 2: checkpoint-2, which it started from, goes once 3 and 4
    exist): the same metrics and final weights, and the same two checkpoints left."""
    from safetensors.torch import load_file
    from test_train import read_metrics, tiny_args

    import train

    common = dict(steps=4, save_every=1, keep_checkpoints=2)
    train.main(tiny_args(tiny_model_dir, tmp_path / "straight", **common))
    assert checkpoints(tmp_path / "straight") == ["checkpoint-000003", "checkpoint-000004"]

    split, real_save, kept = tmp_path / "split", torch.save, {}

    def disk_full_at_step_3(obj, path, *args, **kwargs):
        if ".tmp-checkpoint-000003-" in str(path) and str(path).endswith("trainer_state.pt"):  # the last file
            kept.update(snapshot(split / "checkpoint-000002"))  # what the failed save must leave as it is
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_step_3)
    with pytest.raises(train.CheckpointError, match="checkpoint-000002, is intact"):
        train.main(tiny_args(tiny_model_dir, split, **{**common, "steps": 3, "keep_checkpoints": 1}))
    monkeypatch.setattr(torch, "save", real_save)
    assert kept and sorted(d for d in os.listdir(split) if "checkpoint" in d) == ["checkpoint-000002"]
    assert snapshot(split / "checkpoint-000002") == kept
    train.main(tiny_args(tiny_model_dir, split, **common, resume=str(split)))
    assert checkpoints(split) == ["checkpoint-000003", "checkpoint-000004"]

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "mem/"))} for r in rows]

    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    assert comparable(straight) == comparable(read_metrics(split / "metrics.jsonl"))
    a = load_file(tmp_path / "straight" / "checkpoint-000004" / "model.safetensors")
    b = load_file(split / "checkpoint-000004" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_prune_that_fails_is_a_note_and_the_run_goes_on(tiny_model_dir, tmp_path, digits, monkeypatch, capsys):
    """Deleting old checkpoints can fail (a read-only mount, EACCES): that costs disk, not the run, and under
    torchrun it must not leave rank 0 dead while the other ranks wait for it."""
    from test_train import tiny_args

    import plumbing.checkpoint
    import train

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(plumbing.checkpoint, "prune_checkpoints", refuse)
    final = train.main(tiny_args(tiny_model_dir, tmp_path, steps=2, save_every=1, keep_checkpoints=1))
    assert final["step"] == 2 and checkpoints(tmp_path) == ["checkpoint-000001", "checkpoint-000002"]
    notes = [line for line in capsys.readouterr().out.splitlines() if "could not delete old checkpoints" in line]
    assert len(notes) == 2 and "Permission denied" in notes[0]
