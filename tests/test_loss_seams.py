"""The loss's seams outside loss.py: each policy_loss option is a train.py flag (config.py), each metric it returns
reaches ppo_update's metrics, --entropy-coef trains through the chunked kernel, and the curves name the KL estimator."""

import inspect
import json
import os

import pytest
import torch
from warm_python import run_script

import config
import loss
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def signature_options(fn) -> dict:
    """{name: default} of `fn`'s keyword-only parameters with a default other than None."""
    params = inspect.signature(fn).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.default is not None}


def test_every_policy_loss_option_is_a_flag_with_its_default_and_help():
    """Each keyword option of policy_loss with a default is an Args field (config.py) with that default, its type and
    a help line; the tensors (ref_logp, entropy, ...) are not; the ones naming a registry take its keys as choices."""
    options = signature_options(loss.policy_loss)
    assert {
        "clip_low",
        "clip_high",
        "beta",
        "kl_estimator",
        "entropy_coef",
        "loss_terms",
        "loss_agg",
        "ratio",
        "is_correction",
        "is_cap",
    } <= set(options)
    assert not {"ref_logp", "sampler_logp", "entropy", "denominator", "norm_len"} & set(options)
    fields = {f.name: f for f in config.fields(config.Args)}
    for name, default in options.items():
        assert name in fields, f"policy_loss's option {name} has no Args field in config.py"
        assert fields[name].default == default and fields[name].type is type(default), name
        assert fields[name].metadata["help"], f"{name} has no help line"
    args = config.Args()
    assert (args.clip_low, args.clip_high, args.beta, args.kl_estimator, args.entropy_coef, args.is_cap) == (
        0.2,
        0.28,
        1e-3,
        "k3",
        0.0,
        2.0,
    )  # the paper's, as before
    choices = config.choices()
    for name, registry in loss.OPTION_CHOICES.items():
        assert choices[name] is registry
    assert config.loss_options(config.Args(beta=0.5, ratio="sequence"))["beta"] == 0.5
    assert config.loss_options(config.Args()) == options  # what train.py passes: every option, by its name


def test_a_new_option_of_policy_loss_reaches_it_by_name(monkeypatch):
    """A fork adds a keyword option to policy_loss and its field to config.Args: ppo_update passes it by name."""

    def forked(logp, old_logp, adv, mask, *, ref_logp=None, length_coef: float = 0.0, clip_low=0.2):
        """A fork's loss."""

    monkeypatch.setattr(config, "policy_loss", forked)
    args = config.Args(clip_low=0.1)
    args.length_coef = 0.5  # the fork's new field
    assert signature_options(forked) == {"length_coef": 0.0, "clip_low": 0.2}
    assert config.loss_options(args) == {"length_coef": 0.5, "clip_low": 0.1}


def test_help_lists_the_loss_flags_with_their_defaults():
    out = run_script("train.py", "--help").stdout
    text = "".join(out.split())  # argparse wraps lines, at hyphens too ('token-mean' may break after 'token-')
    for flag, default in (
        ("--clip-low", "0.2"),
        ("--clip-high", "0.28"),
        ("--beta", "0.001"),
        ("--kl-estimator", "'k3'"),
        ("--entropy-coef", "0.0"),
        ("--loss-agg", "'token-mean'"),
        ("--ratio", "'token'"),
        ("--is-correction", "'none'"),
        ("--is-cap", "2.0"),
        ("--loss-terms", "''"),
    ):
        entry = text.rsplit(flag + flag[2:].upper().replace("-", "_"), 1)[1]  # its help, after the usage line
        assert entry.split("unlessthetask'spresetsetsit)", 1)[0].endswith(f"(default{default},"), flag


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(kl_estimator="k9"), "--kl-estimator must be one of k1, k2, k3"),
        (dict(is_correction="token-mask", is_cap=0.5), "--is-cap 0.5: a mask correction keeps ratios in"),
        (dict(loss_terms="nope=1"), "--loss-terms: unknown term 'nope'"),
        (dict(entropy_coef=float("inf")), "--entropy-coef must be finite"),
    ],
)
def test_bad_loss_flags_are_one_line(flags, message, tmp_path):
    error = config.check_args(config.Args(out_dir=str(tmp_path / "run"), **flags))
    assert error is not None and error.startswith(message) and "\n" not in error


# ---- ppo_update on the tiny model: every metric policy_loss returns, and the entropy bonus


def batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 90, (5,), generator=g).tolist() for _ in range(n)]
    completions = [
        torch.randint(4, 90, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    return prompts, completions, torch.randn(n, generator=g)


def update(model_dir, **flags):
    """One ppo_update of the tiny model (plain SGD, no reference): (weights after, metrics)."""
    from transformers import AutoModelForCausalLM

    args = train.Args(M=4, rollout_batch=2, micro_batch=3, beta=0.0, lr=0.1, warmup_steps=0, dtype="float32", **flags)
    prompts, completions, adv = batch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    metrics = train.ppo_update(
        model,
        None,
        optimizer,
        scheduler,
        prompts,
        completions,
        [[0.0] * len(c) for c in completions],
        adv,
        args,
        pad_id=0,
    )
    return model.state_dict(), metrics


def test_a_metric_policy_loss_returns_reaches_the_update_metrics(tiny_model_dir, monkeypatch):
    """A loss term registered in LOSS_TERMS (nothing else edited) is trained on and logged as loss/NAME: the
    token mean of its values over the update's tokens (token-mean aggregation: its Shares add up to it)."""
    monkeypatch.setitem(loss.LOSS_TERMS, "one", lambda logp, old_logp, mask: torch.ones_like(logp) + 0 * logp)
    _, plain = update(tiny_model_dir)
    _, with_term = update(tiny_model_dir, loss_terms="one=0.5")
    assert "loss/one" not in plain and with_term["loss/one"] == pytest.approx(1.0)
    assert with_term["loss/pg"] == plain["loss/pg"]  # the term is its own metric, not folded into loss/pg


def test_entropy_coef_trains_on_the_entropy_and_logs_it(tiny_model_dir):
    """--entropy-coef > 0: the update moves the weights differently (the entropy's gradient reaches them through the
    chunked kernel), loss/entropy is the token mean of the entropies (= policy/entropy under token-mean), and at 0
    the update and its metrics are those of the default flags, bit for bit."""
    default_weights, default = update(tiny_model_dir)
    zero_weights, zero = update(tiny_model_dir, entropy_coef=0.0)
    assert zero == default and all(torch.equal(default_weights[k], zero_weights[k]) for k in default_weights)
    weights, metrics = update(tiny_model_dir, entropy_coef=0.5)
    assert "loss/entropy" not in default
    assert metrics["loss/entropy"] == pytest.approx(metrics["policy/entropy"], rel=1e-5)
    assert any(not torch.allclose(weights[k], default_weights[k], atol=1e-6) for k in weights)


# ---- the curves name the KL estimator


def fake_run(folder, args):
    ckpt = folder / "checkpoint-000002"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    torch.save({}, ckpt / "optimizer.pt")
    torch.save({"step": 2, "args": args}, ckpt / "trainer_state.pt")
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss/kl": 0.01 * s}) + "\n" for s in (1, 2)))
    return str(folder / "metrics.jsonl")


def kl_title(paths, tmp_path, monkeypatch):
    from tools import figures

    saved = []
    monkeypatch.setattr(figures, "_save", lambda fig, out: saved.append(fig) or out)
    figures.plot_training_curves(paths, str(tmp_path / "curves.png"))
    return next(ax.get_title() for ax in saved[-1].axes if ax.get_ylabel() == "loss/kl")


@pytest.mark.curves
def test_the_kl_panel_names_the_runs_estimators(tmp_path, monkeypatch):
    k1 = fake_run(tmp_path / "a", {"kl_estimator": "k1"})
    old = fake_run(tmp_path / "b", {"beta": 1e-3})  # saved before --kl-estimator existed: k3
    assert kl_title([k1], tmp_path, monkeypatch) == "KL to reference (k1)"
    assert kl_title([old], tmp_path, monkeypatch) == "KL to reference (k3)"
    assert kl_title([k1, old], tmp_path, monkeypatch) == "KL to reference (k1 / k3)"
    bare = tmp_path / "c"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss/kl": 0.1}) + "\n")
    assert kl_title([str(bare / "metrics.jsonl")], tmp_path, monkeypatch) == "KL to reference"  # no checkpoint
