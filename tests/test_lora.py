"""--lora-rank on the tiny model: only the adapters train, the reference is the base model (the adapters off), the
samplers and checkpoint-STEP/ get the merged weights, resume is exact, and FSDP2 over 2 ranks equals one process.

    python -m pytest -q tests/test_lora.py
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from dist_train import DigitTask
from safetensors.torch import load_file
from test_train import tiny_args
from torch.distributed.checkpoint import FileSystemReader, load
from transformers import AutoModelForCausalLM

import config
import tasks
import train
from speed.logprobs import sequence_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as we ask
plain_policy_loss = train.policy_loss


@pytest.fixture
def digits(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "digits", DigitTask())
    return "digits"


def lora_args(model_dir, out_dir, **overrides):
    """test_train's tiny run with rank-4 adapters, at the higher lr LoRA needs."""
    return tiny_args(model_dir, out_dir, **{**dict(lr=1e-2, lora_rank=4, beta=1e-3, weight_check_every=1), **overrides})


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def saved_state(ckpt) -> dict:
    """The PeftModel's parameters DCP saved in ckpt/trainer (base and adapters, peft's names)."""
    stored = FileSystemReader(str(ckpt / "trainer")).read_metadata().state_dict_metadata
    state = {key: torch.empty(meta.size) for key, meta in stored.items() if key.startswith("model.")}
    load(state, storage_reader=FileSystemReader(str(ckpt / "trainer")), no_dist=True)
    return {k.removeprefix("model."): v for k, v in state.items()}


def test_lora_flags_are_checked_in_one_line():
    assert "--lora-rank must be >= 0" in config.check_args(train.Args(lora_rank=-1, plan=True, plan_gpus=1))
    assert "--lora-alpha" in config.check_args(train.Args(lora_rank=4, lora_alpha=0.0, plan=True, plan_gpus=1))
    error = config.check_args(train.Args(lora_rank=4, reference="ema", ref_ema=0.5, plan=True, plan_gpus=1))
    assert error.startswith("--lora-rank: the reference is the base model") and "\n" not in error
    assert config.check_args(train.Args(lora_rank=4, plan=True, plan_gpus=1)) is None
    assert {"lora_rank", "lora_targets"} <= set(config.RESUME_KEEPS)  # a resume cannot change the adapters' shapes


@pytest.mark.parametrize(
    "targets,named",
    [
        ("c_attn", "c_attn"),
        ("q_proj,c_attn", "c_attn"),  # one of two unknown
        ("self_attn.q_proj,mlp", "LlamaMLP, not a linear layer"),  # a block peft cannot adapt
        ("embed_tokens", "Embedding, not a linear layer"),
        ("lm_head", "lm_head's weight is tied to the embedding"),  # the tiny model ties its head, as SmolLM2
    ],
)
def test_targets_the_model_lacks_are_one_line(tiny_model_dir, targets, named):
    args = lora_args(tiny_model_dir, "unused", lora_targets=targets)
    with pytest.raises(train.ModelLoadError, match=f"--lora-targets {targets}: ") as info:
        train.load_models(args, None, tiny_model_dir, torch.device("cpu"))
    assert "\n" not in str(info.value) and (repr(named) in str(info.value) or named in str(info.value))


def test_a_rank_above_a_layers_width_is_one_line_before_training(tiny_model_dir, tmp_path):
    """Issue 61, class 8: the tiny model's k_proj is 64 wide (one 64-wide KV head); peft gave a 19-line traceback."""
    result = subprocess.run(
        [sys.executable, "train.py", "--model", tiny_model_dir, "--lora-rank", "100", "--out-dir", tmp_path / "run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert (
        "--lora-rank 100 is above the width of model.layers.0.self_attn.k_proj (64): pass at most 64" in result.stderr
    )
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # nothing trained


def test_a_lora_run_trains_only_the_adapters_and_saves_the_merged_policy(tiny_model_dir, tmp_path, digits, monkeypatch):
    def no_second_model(*args, **kwargs):
        raise AssertionError("LoRA's reference is the base model: no reference is loaded")

    monkeypatch.setattr(train, "load_reference", no_second_model)
    train.main(lora_args(tiny_model_dir, tmp_path, steps=3))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["sync/logprob_diff"] < 1e-4 for r in rows)  # the sampler computes the trainer's (merged) policy
    assert all(r["sync/weight_diff"] == 0.0 for r in rows)  # every family of weights, every step
    assert rows[-1]["sync/sampler_moved"] > 0 and rows[-1]["loss/kl"] > 0  # it moved away from the base
    ckpt = tmp_path / "checkpoint-000003"
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base = dict(initial.named_parameters())
    saved = saved_state(ckpt)
    adapters = {k: v for k, v in saved.items() if ".lora_" in k}
    assert adapters and all(".lora_" in k or k.startswith("base_model.model.") for k in saved)
    for name, tensor in saved.items():  # the base is untouched, bit for bit
        if ".lora_" not in name:
            assert torch.equal(tensor, base[name.removeprefix("base_model.model.").replace(".base_layer.", ".")]), name
    assert all(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # B starts at 0: they trained
    entries = FileSystemReader(str(ckpt / "trainer")).read_metadata().state_dict_metadata
    assert {k.split(".", 1)[1].rsplit(".", 1)[0] for k in entries if k.startswith("optimizer.")} == {
        k for k in adapters
    }  # AdamW's moments: the adapters' alone
    # issue 64: the trainer state holds no base weight (the run's --model does), only the adapters
    assert {k.removeprefix("model.") for k in entries if k.startswith("model.")} == set(adapters)

    # checkpoint-STEP/ is a plain model folder holding the merged policy: W + (alpha / r) B A
    merged = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert merged.config.architectures == ["LlamaForCausalLM"]
    scale = 32.0 / 4
    for name, tensor in merged.named_parameters():
        stem = name.removesuffix(".weight")
        if f"base_model.model.{stem}.lora_A.default.weight" in saved:
            delta = (
                scale
                * saved[f"base_model.model.{stem}.lora_B.default.weight"]
                @ saved[f"base_model.model.{stem}.lora_A.default.weight"]
            )
            assert torch.allclose(tensor, base[name] + delta, atol=1e-6), name
        else:
            assert torch.equal(tensor, base[name]), name  # norms, embedding: frozen

    # and its logits are the trained policy's (the adapters on), which the resume path rebuilds
    args = lora_args(tiny_model_dir, tmp_path / "unused")
    _, policy, _ = train.load_models(args, str(ckpt), tiny_model_dir, torch.device("cpu"))
    optimizer = train.make_optimizer(policy, args)
    train.load_checkpoint(str(ckpt), policy, optimizer, train.make_scheduler(optimizer, args), 0, args)
    ids = torch.randint(4, 90, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert (want - got).abs().max() < 1e-4 and (want - initial(input_ids=ids).logits).abs().max() > 1e-3


def test_the_reference_is_the_base_model_with_the_adapters_off(tiny_model_dir, monkeypatch):
    args = lora_args(tiny_model_dir, "unused", beta=0.1)
    _, model, ref_model = train.load_models(args, None, tiny_model_dir, torch.device("cpu"))
    assert ref_model is model  # no second copy
    base = train.load_model(tiny_model_dir)  # as the policy is loaded: eager attention on CPU
    with torch.no_grad():  # adapters that change the policy
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    seen = []
    monkeypatch.setattr(
        train,
        "policy_loss",
        lambda *a, ref_logp, **kw: seen.append(ref_logp) or plain_policy_loss(*a, ref_logp=ref_logp, **kw),
    )
    prompts = [[5, 6, 7, 8], [9, 10, 11]] * 2
    completions = [[20, 21, 22], [23, 24], [25], [26, 27, 28, 29]]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    metrics = train.ppo_update(
        model,
        ref_model,
        optimizer,
        scheduler,
        prompts,
        completions,
        [[0.0] * len(c) for c in completions],
        torch.tensor([1.0, -1.0, 0.5, -0.5]),
        args,
        pad_id=0,
    )
    order = [i for micro in train.micro_batch_rows(prompts, completions, range(4), args.micro_batch) for i in micro]
    input_ids, attention_mask, mask = train.pad_batch([prompts[i] for i in order], [completions[i] for i in order], 0)
    with torch.no_grad():
        want = sequence_logprobs(base, input_ids, attention_mask, mask.shape[1])
        policy = sequence_logprobs(model, input_ids, attention_mask, mask.shape[1])
        with model.disable_adapter():
            adapters_off = sequence_logprobs(model, input_ids, attention_mask, mask.shape[1])
    # the base model's log-probs, to rounding: with logits_to_keep the wrapped model's forward and the plain one's
    # differ in the last bits on this CPU (seen: 5e-7), though peft adds nothing with the adapters off
    assert len(seen) == 1 and torch.equal(seen[0], adapters_off) and torch.allclose(seen[0], want, atol=1e-5)
    assert (policy - want).abs().max() > 1e-3 and metrics["loss/kl"] > 0  # the adapters are on again after it
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())


def test_a_resumed_lora_run_equals_the_straight_run(tiny_model_dir, tmp_path, digits):
    common = dict(steps=4, minibatches=2, ppo_epochs=2, micro_batch=3, warmup_steps=3)
    train.main(lora_args(tiny_model_dir, tmp_path / "straight", **common))
    train.main(lora_args(tiny_model_dir, tmp_path / "split", **{**common, "steps": 2}))
    train.main(lora_args(tiny_model_dir, tmp_path / "split", **common, resume=str(tmp_path / "split")))

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert len(straight) == 4 and comparable(straight) == comparable(read_metrics(tmp_path / "split" / "metrics.jsonl"))
    a = load_file(tmp_path / "straight" / "checkpoint-000004" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoint-000004" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = (
        saved_state(tmp_path / "straight" / "checkpoint-000004"),
        saved_state(tmp_path / "split" / "checkpoint-000004"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def torchrun(*job):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            os.path.join(ROOT, "tests", "dist_train.py"),
            *job,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_one_lora_update_under_torchrun_2_equals_one_process(tiny_model_dir, tmp_path):
    single = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "dist_train.py"),
            "lora-parity",
            str(tmp_path / "one.pt"),
            tiny_model_dir,
        ],
        capture_output=True,
        text=True,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    double = torchrun("lora-parity", str(tmp_path / "two.pt"), tiny_model_dir)
    assert double.returncode == 0, double.stderr[-3000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert one["state"].keys() == two["state"].keys() == initial.keys() - {"lm_head.weight"}  # the base's names
    scale = max((one["state"][k] - initial[k]).abs().max().item() for k in one["state"])
    assert scale > 0
    for name, want in one["state"].items():
        assert torch.allclose(two["state"][name], want, rtol=1e-6, atol=1e-4 * scale), name
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert one["metrics"]["loss/kl"] > 0


@pytest.mark.slow
def test_a_lora_run_under_torchrun_2_syncs_checks_and_saves_the_merged_policy(tiny_model_dir, tmp_path):
    result = torchrun("lora-e2e", str(tmp_path), tiny_model_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sync/logprob_diff"] < 1e-4 and r["sync/weight_diff"] == 0.0 for r in rows)
    assert all(math.isfinite(r["loss/kl"]) for r in rows) and rows[-1]["loss/kl"] > 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-000003", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert merged.config.architectures == ["LlamaForCausalLM"]
    moved = {n for n, p in merged.named_parameters() if not torch.equal(p, initial.get_parameter(n))}
    assert moved and all(n.endswith("_proj.weight") for n in moved)  # the adapted linears alone


def test_the_memory_plan_trains_and_steps_the_adapters_alone(tiny_model_dir):
    from dataclasses import asdict

    from tools.memory_plan import model_shape, plan

    args = lora_args(tiny_model_dir, "unused")
    _, model, _ = train.load_models(args, None, tiny_model_dir, torch.device("cpu"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model_shape(tiny_model_dir).lora_params(4, args.lora_targets) == trained  # peft's count
    kept = dict(gpus=1, gpu_gb=80, grad_checkpointing=False, prompt_tokens=8, torchrun=False)
    rows = {(ph, item): size for ph, item, size, _ in plan(asdict(args), **kept).rows}
    full = {(ph, item): size for ph, item, size, _ in plan({**asdict(args), "lora_rank": 0}, **kept).rows}
    assert rows["train", "adamw"] == 8 * trained and rows["train", "grads"] == 4 * trained
    assert rows["train", "reference"] == 0 < full["train", "reference"]  # the base is the reference
    assert rows["train", "params"] == full["train", "params"] + 4 * trained  # the frozen base, whole, + adapters
    with pytest.raises(ValueError, match="--lora-targets c_attn"):
        model_shape(tiny_model_dir).lora_params(4, "q_proj,c_attn")


def test_lora_with_gradient_checkpointing_trains_as_without(tiny_model_dir, tmp_path, digits):
    for ckpt in (False, True):
        train.main(lora_args(tiny_model_dir, tmp_path / str(ckpt), grad_checkpointing=ckpt))
    a = load_file(tmp_path / "False" / "checkpoint-000002" / "model.safetensors")
    b = load_file(tmp_path / "True" / "checkpoint-000002" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_the_tiny_model_learns_the_bandit_task_through_its_adapters(tiny_model_dir, tmp_path, digits):
    train.main(
        lora_args(
            tiny_model_dir,
            tmp_path,
            M=8,
            micro_batch=32,
            steps=12,
            max_tokens=2,
            eval_examples=8,
            lr=3e-2,
            beta=0.0,
            weight_check_every=0,
        )
    )
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert sum(rewards[-3:]) > sum(rewards[:3]), rewards  # seen: 0.09 over the first 3 steps, 0.22 over the last
    evals = json.loads((tmp_path / "eval.json").read_text())
    assert evals["after"] >= evals["before"] + 0.5, evals  # greedy: seen 0 -> 1 of 8 held-out prompts


def test_resume_changed_cannot_add_or_drop_adapters(tiny_model_dir, tmp_path, digits):
    """Issue 61, class 9: --resume-changed across LoRA and non-LoRA called a healthy checkpoint "corrupt"."""
    args = tiny_args(tiny_model_dir, tmp_path / "run", steps=1)
    train.main(args)
    for change in (dict(lora_rank=4), dict(lora_rank=4, lora_targets="q_proj")):
        resumed = config.replace(args, steps=2, resume=str(tmp_path / "run"), resume_changed=True, **change)
        error = config.check_args(resumed)
        assert "--lora-rank 0, not 4, which even --resume-changed cannot change" in error, error
        assert "corrupt" not in error and f"--model {tmp_path / 'run' / 'checkpoint-000001'}" in error
