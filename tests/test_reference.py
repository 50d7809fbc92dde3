"""The KL term's reference policy (loss.py: REFERENCES, --reference; train.py: update_reference): a moving
reference is checkpoint state, so a resume equals the straight run to the bit; under bf16 it accumulates in float32;
bad combinations are one line.
"""

import pytest
import torch
from dist_train import DigitTask
from test_train import read_metrics, tiny_args

import config
import tasks
import train
from loss import REFERENCES
from plumbing.checkpoint import read_trainer_state


@pytest.fixture
def digits(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "digits", DigitTask())


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "mem/"))} for r in rows]


@pytest.mark.parametrize("reference", [dict(reference="ema", ref_ema=0.5), dict(reference="reset", ref_reset_every=2)])
def test_a_moving_reference_resumes_to_the_bit(tiny_model_dir, tmp_path, digits, reference):
    """3 straight steps against 2 steps + --resume: the same KL at every step (and every other number), the same
    weights. A frozen run's step-3 KL differs, so the reference did move; before it was checkpointed, the resume
    reloaded the initial model and its step-3 KL was the frozen one's."""
    from safetensors.torch import load_file

    common = dict(steps=3, beta=0.1, lr=1e-2, save_every=1, **reference)
    train.main(tiny_args(tiny_model_dir, tmp_path / "straight", **common))
    train.main(tiny_args(tiny_model_dir, tmp_path / "split", **{**common, "steps": 2}))
    assert read_trainer_state(str(tmp_path / "split" / "checkpoint-000002"))["reference"] is True
    train.main(tiny_args(tiny_model_dir, tmp_path / "split", **common, resume=str(tmp_path / "split")))
    train.main(tiny_args(tiny_model_dir, tmp_path / "frozen", steps=3, beta=0.1, lr=1e-2))

    straight = comparable(read_metrics(tmp_path / "straight" / "metrics.jsonl"))
    assert straight == comparable(read_metrics(tmp_path / "split" / "metrics.jsonl"))
    frozen = read_metrics(tmp_path / "frozen" / "metrics.jsonl")
    assert straight[2]["loss/kl"] != frozen[2]["loss/kl"]
    assert straight[0]["loss/kl"] == frozen[0]["loss/kl"] == 0.0  # step 1: the reference is the policy
    a = load_file(tmp_path / "straight" / "checkpoint-000003" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoint-000003" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_frozen_run_saves_no_reference(tiny_model_dir, tmp_path, digits):
    train.main(tiny_args(tiny_model_dir, tmp_path, steps=1, beta=0.1))
    assert read_trainer_state(str(tmp_path / "checkpoint-000001"))["reference"] is False


def test_ema_and_reset_move_the_reference_as_written():
    ref, policy = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 2.0])
    REFERENCES["ema"](ref, policy, 1, ref_ema=0.25, ref_reset_every=0)
    assert torch.equal(ref, torch.tensor([1.5, -1.0]))  # (1 - 0.25) ref + 0.25 policy
    ref = torch.tensor([1.0, -2.0])
    for step in (1, 2):
        REFERENCES["reset"](ref, policy, step, ref_ema=0.0, ref_reset_every=3)
    assert torch.equal(ref, torch.tensor([1.0, -2.0]))
    REFERENCES["reset"](ref, policy, 3, ref_ema=0.0, ref_reset_every=3)
    assert torch.equal(ref, policy)


def test_a_tiny_ema_step_is_kept_under_bf16(tiny_model_dir):
    """Under bf16 a frozen reference's linears are stored in bf16 (speed/backward.py); a moving one stays float32,
    so an EMA step far below bf16's resolution accumulates instead of rounding away."""
    frozen_args = tiny_args(tiny_model_dir, "unused", dtype="bfloat16", beta=0.1)
    _, _, frozen = train.load_models(frozen_args, None, tiny_model_dir, torch.device("cpu"))
    assert frozen.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # the default, unchanged
    args = tiny_args(tiny_model_dir, "unused", dtype="bfloat16", beta=0.1, reference="ema", ref_ema=1e-3)
    _, model, ref_model = train.load_models(args, None, tiny_model_dir, torch.device("cpu"))
    weight = ref_model.model.layers[0].mlp.up_proj.weight
    assert weight.dtype == torch.float32
    before = weight.clone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)  # the policy moved by 1e-3: an EMA step of 1e-6, below bf16's spacing near these weights
    train.update_reference(ref_model, model, 1, args)
    assert torch.allclose(weight - before, torch.full_like(before, 1e-6), atol=1e-7)
    policy16 = model.model.layers[0].mlp.up_proj.weight.detach().bfloat16().float()
    stepped16 = before.bfloat16().float().lerp(policy16, 1e-3).bfloat16()  # the same step on bf16 storage
    assert (stepped16 != before.bfloat16()).float().mean() < 0.1  # rounds away but for the tiniest weights


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--reference", "nope"], "--reference must be one of"),
        (["--reference", "ema"], "--reference ema needs --ref-ema"),
        (["--reference", "reset"], "--reference reset needs --ref-reset-every"),
        (["--ref-ema", "0.1"], "pass --reference ema or reset"),
        (["--ref-reset-every", "5"], "pass --reference ema or reset"),
        (["--reference", "ema", "--ref-ema", "1.5"], "--ref-ema must be in [0, 1]"),
        (["--reference", "ema", "--ref-ema", "0.1", "--beta", "0"], "--beta 0 has none"),
        (["--dist-timeout-s", "0"], "--dist-timeout-s must be"),
    ],
)
def test_bad_reference_flags_are_one_line(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args([*flags, "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_the_registry_holds_the_three_references():
    assert REFERENCES["frozen"] is None and {"ema", "reset"} <= set(REFERENCES)
    assert set(REFERENCES) <= set(config.choices()["reference"])
