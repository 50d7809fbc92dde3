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
    assert sorted(os.listdir(tmp_path)) == [
        ".tmp-checkpoint-3000000-abc",
        "checkpoint-1000000",
        "checkpoint-2000000",
        "checkpoint-999999",
        "checkpoint-notes",
        "metrics.jsonl",
    ]
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


# ---- the DCP checkpoint (plumbing/checkpoint.py; under torchrun: tests/test_dcp.py)


def test_a_resume_restores_its_own_gpus_rng_state_however_many_are_visible(monkeypatch):
    """Each process saves the RNG state of its own GPU: a checkpoint saved where 4 GPUs were visible restores on a
    machine with 2 (set_rng_state_all would index devices that do not exist), into the current device."""
    from plumbing import checkpoint

    restored, rng = [], {**checkpoint.rng_state(), "cuda": torch.full((4,), 3, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append((state, device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("indexes every saved device"))
    checkpoint.set_rng_state(rng)
    assert len(restored) == 1 and torch.equal(restored[0][0], rng["cuda"]) and restored[0][1] == "cuda"


def tiny_trainer(model_dir):
    from test_train import tiny_args

    import train
    from plumbing.models import load_tokenizer

    args = tiny_args(model_dir, "unused")
    _, model, _ = train.load_models(args, None, model_dir, torch.device("cpu"))
    optimizer = train.make_optimizer(model, args)
    return args, model, optimizer, train.make_scheduler(optimizer, args), load_tokenizer(model_dir)


def test_a_run_folder_made_read_only_mid_run_is_one_line_from_the_save(tiny_model_dir, tmp_path, monkeypatch):
    """Root ignores chmod, so the read-only folder is the temp folder's PermissionError, as it comes without
    dac_override: one line naming the save and the last good checkpoint, nothing left behind."""
    from plumbing.checkpoint import CheckpointError, save_checkpoint

    args, model, optimizer, scheduler, tokenizer = tiny_trainer(tiny_model_dir)
    save_checkpoint(str(tmp_path), 1, model, optimizer, scheduler, tokenizer, args)
    before = snapshot(tmp_path)
    real_mkdir = os.mkdir

    def read_only(path, *a, **k):
        if os.path.dirname(path) == str(tmp_path):
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(str(tmp_path), 2, model, optimizer, scheduler, tokenizer, args)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"saving checkpoint {tmp_path / 'checkpoint-000002'} failed")
    assert f"cannot write in {tmp_path}: Permission denied" in message and "checkpoint-000001, is intact" in message
    assert snapshot(tmp_path) == before


def test_dcp_metadata_that_needs_an_object_is_refused_before_anything_loads(tmp_path, capsys):
    """DCP's own reader unpickles .metadata with pickle.load; ours allows DCP's metadata classes alone."""
    import pickle

    from test_bad_input import WritesAFile, fake_checkpoint

    import train

    marker = tmp_path / "ran.txt"
    ckpt = fake_checkpoint(tmp_path / "run", 1, {"step": 1, "args": {"task": "arith", "model": "smollm2-135m"}})
    (ckpt / "trainer" / ".metadata").write_bytes(pickle.dumps(WritesAFile(marker)))
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--resume", str(ckpt), "--out-dir", str(tmp_path / "out"), "--steps", "5"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "trainer/.metadata needs builtins.exec to load" in err and "refused" in err and not marker.exists()


def test_a_moved_run_and_a_copied_model_folder_resume_exactly(tiny_model_dir, tmp_path, digits):
    """The run folder moved and the model folder copied elsewhere (--model changed: --resume-changed) resume, to the
    bit; another model without --resume-changed does not."""
    import shutil

    from test_train import read_metrics, tiny_args

    import config
    import train
    from tools.tiny_model import build_tiny_model

    first = tmp_path / "models" / "first"
    shutil.copytree(tiny_model_dir, first)
    train.main(tiny_args(tiny_model_dir, tmp_path / "straight", steps=3, beta=0.1))
    train.main(tiny_args(str(first), tmp_path / "run", steps=2, beta=0.1))
    shutil.move(tmp_path / "run", tmp_path / "moved")
    moved_model = tmp_path / "elsewhere" / "copy"
    shutil.copytree(first, moved_model)
    shutil.rmtree(first)
    args = tiny_args(
        str(moved_model), tmp_path / "moved", steps=3, beta=0.1, resume=str(tmp_path / "moved"), resume_changed=True
    )
    assert config.check_args(args) is None
    train.main(args)

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "mem/"))} for r in rows]

    assert comparable(read_metrics(tmp_path / "moved" / "metrics.jsonl")) == comparable(
        read_metrics(tmp_path / "straight" / "metrics.jsonl")
    )
    other = build_tiny_model(tmp_path / "other", seed=1)
    error = config.check_args(tiny_args(other, tmp_path / "moved", steps=4, resume=str(tmp_path / "moved")))
    assert error and f"was trained with --model {tmp_path / 'elsewhere' / 'copy'}, not {other}" in error


def test_a_tied_head_is_saved_once_and_every_file_is_fsynced_before_the_rename(tiny_model_dir, tmp_path, monkeypatch):
    """The tiny model ties lm_head to the embedding: one key in DCP and in the HF folder, as save_pretrained of an
    unsharded model writes it; a resume and from_pretrained tie it again. Each file and folder of the save is
    fsynced before the rename that marks it complete, and the run folder after it (a power cut keeps either the
    last checkpoint or a complete new one)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from plumbing.checkpoint import load_checkpoint, save_checkpoint

    args, model, optimizer, scheduler, tokenizer = tiny_trainer(tiny_model_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(1.0)  # not the initial weights
    events, real_fsync, real_rename = [], os.fsync, os.rename
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd)
    )
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("rename", str(a), str(b))) or real_rename(a, b))
    save_checkpoint(str(tmp_path), 1, model, optimizer, scheduler, tokenizer, args)
    monkeypatch.setattr(os, "fsync", real_fsync)
    ckpt = tmp_path / "checkpoint-000001"
    (rename,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(ckpt)]
    tmp = events[rename][1]
    synced = {e[1] for e in events[:rename] if e[0] == "fsync"}
    for folder, _, names in os.walk(ckpt):
        moved = folder.replace(str(ckpt), tmp, 1)
        assert moved in synced and all(os.path.join(moved, n) in synced for n in names), (folder, names)
    assert ("fsync", str(tmp_path)) in events[rename:]

    dcp_keys = FileSystemReader(str(ckpt / "trainer")).read_metadata().state_dict_metadata
    assert "model.model.embed_tokens.weight" in dcp_keys and "model.lm_head.weight" not in dcp_keys
    hf = load_file(ckpt / "model.safetensors")
    assert "model.embed_tokens.weight" in hf and "lm_head.weight" not in hf
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert torch.equal(reloaded.lm_head.weight, model.get_input_embeddings().weight)
    _, fresh, fresh_optimizer, fresh_scheduler, _ = tiny_trainer(tiny_model_dir)
    assert load_checkpoint(str(ckpt), fresh, fresh_optimizer, fresh_scheduler, 0, args) == 1
    assert fresh.lm_head.weight is fresh.get_input_embeddings().weight
    assert torch.equal(fresh.lm_head.weight, model.get_input_embeddings().weight)  # resumed, still tied


def test_dcp_metadata_with_a_pickled_entry_is_refused_before_it_loads(tmp_path, capsys):
    """DCP loads a byte entry with torch.load(weights_only=False): a folder holding one is refused, payload unrun."""
    import torch.distributed.checkpoint as dcp
    from test_bad_input import WritesAFile, fake_checkpoint

    import train

    marker = tmp_path / "ran.txt"
    ckpt = fake_checkpoint(tmp_path / "run", 1, {"step": 1, "args": {"task": "arith", "model": "smollm2-135m"}})
    tampered = {"model.weight": torch.zeros(2), "payload": WritesAFile(marker)}
    dcp.save(tampered, storage_writer=dcp.FileSystemWriter(str(ckpt / "trainer")), no_dist=True)
    assert not marker.exists()  # saving pickles the payload without running it
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--resume", str(ckpt), "--out-dir", str(tmp_path / "out"), "--steps", "5"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "1 pickled entries (e.g. payload)" in err and "refused" in err and "corrupt" not in err
    assert not marker.exists()


@pytest.mark.parametrize("where, signals", [("trainer_state.pt", 1), ("a DCP shard", 1), ("a DCP shard", 2)])
def test_an_interrupt_inside_the_save_waits_for_it_then_arrives(
    where, signals, tiny_model_dir, tmp_path, digits, monkeypatch
):
    """Issue 61, class 9: a SIGTERM inside torch.save blamed the disk (torch.save turns the interrupt into an I/O
    error). Held for the whole save, it arrives after: the checkpoint is whole, then the interrupt. CI at 618e938
    met it inside DCP's shard writer, which torch.save also serves (it hands it a stream, not a path). A second
    signal stops the save at once, so a save that hangs still stops, and leaves no partial folder."""
    import signal

    from test_train import tiny_args

    import train
    from plumbing import checkpoint
    from plumbing.checkpoint import read_trainer_state

    save = torch.save
    sent = []

    def interrupted_save(obj, target, *args, **kwargs):
        shard = not isinstance(target, (str, os.PathLike))  # DCP hands torch.save a stream
        hit = str(target).endswith(where) or (shard and where == "a DCP shard")
        while hit and len(sent) < signals:
            sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return save(obj, target, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", interrupted_save)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as train.py's __main__
    try:
        with pytest.raises(KeyboardInterrupt):
            train.main(tiny_args(tiny_model_dir, tmp_path / "run", steps=1))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert checkpoints(tmp_path / "run") == (["checkpoint-000001"] if signals == 1 else [])
    if signals == 1:
        assert read_trainer_state(str(tmp_path / "run" / "checkpoint-000001"))["step"] == 1  # whole, and readable
    assert not [name for name in os.listdir(tmp_path / "run") if name.startswith(".tmp-")]
