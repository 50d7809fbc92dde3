"""classify.py (Section 6.1): each method's loss and gradient on a hand-checked case; a short run learns."""

import math

import pytest
import torch

from tools.classify import make_problem, ml_loss, pg_loss, rl_loss, train

# The hand case: one example, two classes, logits (0, log 3) -> pi = (1/4, 3/4); the label is class 0.
# Two rollouts sampled as classes (0, 1) -> rewards (1, 0).
#   log pi(0) = log 1/4, log pi(1) = log 3/4;   d log pi(k) / d logits = onehot(k) - pi
#   grad log pi(0) = (3/4, -3/4),  grad log pi(1) = (-1/4, 1/4)
# loss = -(A_0 log pi(0) + A_1 log pi(1)) / 2. With A = (a, -a) (every estimator here is antisymmetric
# for one success in two) the loss is -(a/2) log((1/4) / (3/4)) = (a/2) log 3 and the gradient
# -(a/2) (grad log pi(0) - grad log pi(1)) = -(a/2) (1, -1) = (-a/2, a/2).
#   GRPO:       mean 1/2, population std 1/2 -> a = 1 (up to eps = 1e-6)
#   MaxRL:      (R - 1/2) / (1/2)            -> a = 1
#   REINFORCE:  batch mean 1/2               -> a = 1/2
#   softmax:    w = (c, 1) / (c + 1), c = e^(1/tau); A = 2w - 1 -> a = (c - 1) / (c + 1) = tanh(1 / (2 tau))
LOGITS = [[0.0, math.log(3.0)]]
LABELS = torch.tensor([0])
ACTIONS = torch.tensor([[0, 1]])
HAND_A = {"grpo": 1.0, "maxrl": 1.0, "reinforce": 0.5, "softmax": math.tanh(1 / (2 * 0.5))}


@pytest.mark.parametrize("estimator", sorted(HAND_A))
def test_pg_loss_hand_case(estimator):
    logits = torch.tensor(LOGITS, requires_grad=True)
    loss = pg_loss(logits, LABELS, ACTIONS, estimator, tau=0.5)
    loss.backward()
    a = HAND_A[estimator]
    assert loss.item() == pytest.approx(a / 2 * math.log(3.0), rel=1e-5)
    assert logits.grad.tolist()[0] == pytest.approx([-a / 2, a / 2], rel=1e-5)


def test_ml_loss_hand_case():
    # -log pi(0) = log 4; gradient -(onehot(0) - pi) = (-3/4, 3/4).
    logits = torch.tensor(LOGITS, requires_grad=True)
    loss = ml_loss(logits, LABELS)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(4.0), rel=1e-6)
    assert logits.grad.tolist()[0] == pytest.approx([-0.75, 0.75], rel=1e-6)


def test_reinforce_baseline_is_the_batch_mean():
    # Two examples, rewards (1, 0) and (0, 0): the batch mean is 1/4, so A = (3/4, -1/4 | -1/4, -1/4).
    # A per-group baseline would give the second example A = 0 and so no gradient.
    logits = torch.zeros(2, 2, requires_grad=True)  # pi = (1/2, 1/2) for both
    actions = torch.tensor([[0, 1], [1, 1]])
    loss = pg_loss(logits, torch.tensor([0, 0]), actions, "reinforce")
    loss.backward()
    # loss = -(1/4) sum_i A_i log(1/2) = (log 2 / 4) sum_i A_i = 0 (a batch baseline sums to zero).
    # Example 2's logits: -(1/4) * (2 * -1/4) * grad log pi(1) = (1/8) * (-1/2, 1/2) = (-1/16, 1/16).
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    assert logits.grad[1].tolist() == pytest.approx([-1 / 16, 1 / 16], rel=1e-6)
    g = pg_loss(logits.detach().requires_grad_(), torch.tensor([0, 0]), actions, "grpo")
    assert g.item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("estimator", ["grpo", "softmax", "maxrl"])
def test_group_estimators_ignore_all_fail_groups(estimator):
    logits = torch.randn(3, 5, requires_grad=True)
    actions = torch.tensor([[1, 2, 3, 4]] * 3)  # never the label 0
    pg_loss(logits, torch.zeros(3, dtype=torch.long), actions, estimator, tau=0.1).backward()
    assert logits.grad.abs().max().item() == 0.0


def test_rl_loss_is_seeded_and_matches_pg_loss():
    logits = torch.randn(4, 7)
    labels = torch.tensor([0, 1, 2, 3])
    a = rl_loss(logits, labels, 16, "softmax", 0.1, torch.Generator().manual_seed(3))
    b = rl_loss(logits, labels, 16, "softmax", 0.1, torch.Generator().manual_seed(3))
    actions = torch.multinomial(
        torch.softmax(logits, -1), 16, replacement=True, generator=torch.Generator().manual_seed(3)
    )
    assert a.item() == b.item() == pg_loss(logits, labels, actions, "softmax", 0.1).item()


def test_problem_is_balanced_and_low_pass_rate():
    problem = make_problem(n_classes=100, n_train=20_000, n_test=100)
    assert problem["entropy_bits"] > 0.98 * problem["max_entropy_bits"]
    assert problem["max_class_frac"] < 3 / 100


def test_short_run_learns():
    # 20 classes (chance 5%); SoftmaxGRPO with 32 rollouts and ML both well above chance in 200 steps.
    problem = make_problem(n_classes=20, dim=16, n_train=4000, n_test=1000, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend on a shared CPU
    try:
        for method in ("softmax", "ml"):
            r = train(
                method, 32, problem, tau=0.1, seed=0, steps=200, batch_size=64, lr=3e-3, hidden=64, eval_every=100
            )
            assert r["acc"] > 0.5, (method, r["acc"])  # starts at ~0.05
            assert r["pass1"] > r["curve"]["pass1"][0] - 0.05  # no collapse after the first eval
    finally:
        torch.set_num_threads(threads)
    assert r["train_reward"] == []  # ML samples nothing
