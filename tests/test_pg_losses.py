"""The policy-gradient registry (loss.py: PG_LOSSES: ppo, dual-clip, cispo, sapo) and the top-entropy token mask:
hand values from each paper's equation, gradients by autograd against a direct formula, a metric in loss/, and
option names that policy_loss never rebinds.

    python -m pytest tests/test_pg_losses.py -q
"""

import ast
import inspect
import math

import pytest
import torch

from loss import PG_LOSSES, policy_loss

LOW, HIGH = 0.2, 0.28


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# (adv, rho, logp) -> the per-token loss each paper's equation gives, by hand
HAND = {
    "ppo": [(1.0, 1.5, -0.7, -1.28), (-1.0, 0.5, -0.7, 0.8), (-1.0, 5.0, -0.7, 5.0), (2.0, 1.1, -0.7, -2.2)],
    "dual-clip": [(-1.0, 5.0, -0.7, 3.0), (-2.0, 2.0, -0.7, 4.0), (-1.0, 2.0, -0.7, 2.0), (1.0, 5.0, -0.7, -1.28)],
    "cispo": [(2.0, 1.5, -0.7, -2 * 1.28 * -0.7), (-1.0, 0.5, -0.7, 1 * 0.8 * -0.7), (1.0, 1.1, -0.3, -1.1 * -0.3)],
    "sapo": [
        (1.0, 1.2, -0.7, -sigmoid(0.2) * 4),
        (-1.0, 1.2, -0.7, sigmoid(1.05 * 0.2) * 4 / 1.05),
        (2.0, 0.5, -0.7, -2 * sigmoid(-0.5) * 4),
    ],
}


def direct_grad(name: str, adv: float, rho: float) -> float:
    """d loss / d logp of one token, from the equation: rho = exp(logp - old), so d rho / d logp = rho."""
    clipped = min(max(rho, 1 - LOW), 1 + HIGH)
    unclipped_branch = -adv * rho >= -adv * clipped  # PPO's max takes the unclipped term
    if name == "ppo":
        return -adv * rho if unclipped_branch else 0.0
    if name == "dual-clip":
        bound_acts = adv < 0 and max(-adv * rho, -adv * clipped) > -3 * adv
        return 0.0 if bound_acts else direct_grad("ppo", adv, rho)
    if name == "cispo":
        return -adv * clipped
    tau = 1.0 if adv > 0 else 1.05  # sapo: d/d rho of 4 / tau sigmoid(tau (rho - 1)) is 4 s (1 - s)
    s = sigmoid(tau * (rho - 1))
    return -adv * 4 * s * (1 - s) * rho


def test_the_registry_holds_the_paper_default_and_the_newer_losses():
    assert {"ppo", "dual-clip", "cispo", "sapo"} <= set(PG_LOSSES)
    assert inspect.signature(policy_loss).parameters["pg_loss"].default == "ppo"


@pytest.mark.parametrize("name", ["ppo", "dual-clip", "cispo", "sapo"])
def test_each_policy_gradient_term_against_hand_values_and_its_autograd_gradient(name):
    for adv, rho, logp_value, want in HAND[name]:
        old = logp_value - math.log(rho)
        logp = torch.tensor([[logp_value]], dtype=torch.float64, requires_grad=True)
        loss_value, metrics = policy_loss(
            logp,
            torch.tensor([[old]], dtype=torch.float64),
            torch.tensor([adv], dtype=torch.float64),
            torch.ones(1, 1),
            beta=0.0,
            clip_low=LOW,
            clip_high=HIGH,
            pg_loss=name,
        )
        assert loss_value.item() == pytest.approx(want, rel=1e-9), (name, adv, rho)
        loss_value.backward()
        assert logp.grad.item() == pytest.approx(direct_grad(name, adv, rho), rel=1e-9, abs=1e-12), (name, adv, rho)
        assert metrics["pg"] == pytest.approx(want, rel=1e-9)


def test_each_newer_term_logs_its_own_metric_in_loss():
    adv = torch.tensor([-1.0, 1.0, -1.0, 2.0])
    rho = torch.tensor([[5.0], [1.5], [1.0], [1.2]])
    logp = torch.zeros(4, 1)
    got = {
        name: policy_loss(logp, logp - rho.log(), adv, torch.ones(4, 1), beta=0.0, pg_loss=name)[1]
        for name in PG_LOSSES
    }
    assert got["dual-clip"]["dual_clip_frac"] == pytest.approx(1 / 4)  # the first token alone: 5 > 3
    assert got["cispo"]["cispo_clip_frac"] == pytest.approx(2 / 4)  # 5 and 1.5 lie outside [0.8, 1.28]
    taus_rhos = [(1.05, 5), (1, 1.5), (1.05, 1), (1, 1.2)]  # tau_neg where A < 0
    gates = [4 * sigmoid(t * (r - 1)) * (1 - sigmoid(t * (r - 1))) for t, r in taus_rhos]
    assert got["sapo"]["sapo_gate_weight"] == pytest.approx(sum(gates) / 4, rel=1e-6)
    assert not {"dual_clip_frac", "cispo_clip_frac", "sapo_gate_weight"} & set(got["ppo"])  # the paper's: as before


def test_the_default_term_is_the_papers_clip_to_the_bit():
    gen = torch.Generator().manual_seed(0)
    logp, old = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    adv, mask = torch.randn(4, generator=gen), (torch.rand(4, 6, generator=gen) > 0.2).float()
    rho = torch.exp((logp - old).clamp(-20, 20))
    by_hand = torch.maximum(-adv[:, None] * rho, -adv[:, None] * rho.clamp(1 - 0.2, 1 + 0.28))  # Eq. 10
    want = (by_hand * mask).sum() / mask.sum()
    assert torch.equal(policy_loss(logp, old, adv, mask, beta=0.0)[0], want)


def test_policy_loss_never_rebinds_an_option_name():
    """A fork's option named like a local (pg_loss, ratio were rebound) was overwritten and its branch never ran."""
    tree = ast.parse(inspect.getsource(policy_loss))
    function = tree.body[0]
    options = {arg.arg for arg in function.args.kwonlyargs}
    assert {"ratio", "pg_loss", "top_entropy"} <= options
    rebound = {node.id for node in ast.walk(function) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    assert not options & rebound, options & rebound


def test_the_top_entropy_mask_keeps_the_highest_entropy_share_of_tokens():
    logp, old = torch.zeros(1, 4, requires_grad=True), torch.zeros(1, 4)
    entropy = torch.tensor([[0.1, 0.9, 0.5, 0.3]])
    value, metrics = policy_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 4), beta=0.0, entropy=entropy, top_entropy=0.5
    )
    value.backward()
    # the median of the four entropies is 0.4: tokens 1 and 2 keep their -A rho / 4 gradient, the others none
    assert logp.grad.tolist() == [[0.0, -0.25, -0.25, 0.0]]
    assert metrics["entropy_kept_frac"] == 0.5 and value.item() == pytest.approx(-0.5)
    with pytest.raises(AttributeError):  # no entropies, no mask: train.py computes them for --top-entropy < 1
        policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 4), top_entropy=0.5)
    masked, metrics = policy_loss(logp, old, torch.tensor([1.0]), torch.zeros(1, 4), entropy=entropy, top_entropy=0.5)
    assert masked.item() == 0.0 and "entropy_kept_frac" not in metrics  # a micro-batch the row filter emptied


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pg-loss", "grpo"], "--pg-loss must be one of ppo, dual-clip, cispo, sapo"),
        (["--top-entropy", "0"], "--top-entropy must be in (0, 1]"),
    ],
)
def test_the_new_flags_refuse_what_they_cannot_mean(argv, message, capsys, tmp_path):
    from tests.test_nothing_silent import train_refuses

    assert message in train_refuses(argv, capsys, tmp_path)


@pytest.mark.parametrize(
    "pg_loss, metric",
    [("cispo", "loss/cispo_clip_frac"), ("sapo", "loss/sapo_gate_weight"), ("dual-clip", "loss/dual_clip_frac")],
)
def test_a_run_logs_its_terms_metric_and_the_kept_share(pg_loss, metric, tiny_model_dir, tmp_path, monkeypatch):
    import tasks
    import train
    from tests.dist_train import DigitTask
    from tests.test_train import read_metrics, tiny_args

    monkeypatch.setitem(tasks.TASKS, "digits", DigitTask())
    train.main(tiny_args(tiny_model_dir, tmp_path, steps=2, pg_loss=pg_loss, top_entropy=0.5))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(0 <= row[metric] <= 1 and 0 < row["loss/entropy_kept_frac"] <= 1 for row in rows)
