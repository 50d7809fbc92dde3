"""advantage.py: Eq. (1) properties and limits; tools/theory.py: the exact prompt weight omega_M(p) against theory."""

import math

import numpy as np
import pytest
import torch

from advantage import (
    ESTIMATORS,
    compute_advantages,
    drgrpo_advantages,
    estimator_params,
    gdpo_advantages,
    grpo_advantages,
    hyperparameter_ranges,
    hyperparameters,
    maxrl_advantages,
    reinforce_advantages,
    rloo_advantages,
    softmax_advantages,
)
from config import Args, check_args
from tests.test_nothing_silent import train_refuses
from tools.theory import population_weight


def test_softmax_sums_to_zero_and_matches_eq1():
    torch.manual_seed(0)
    rewards = torch.rand(5, 8)
    adv = softmax_advantages(rewards, tau=0.3)
    assert torch.allclose(adv.sum(-1), torch.zeros(5), atol=1e-5)
    w = torch.exp(rewards / 0.3) / torch.exp(rewards / 0.3).sum(-1, keepdim=True)
    assert torch.allclose(adv, 8 * w - 1, atol=1e-5)


def test_softmax_shift_and_permutation_invariant():
    torch.manual_seed(1)
    rewards = torch.rand(3, 6, dtype=torch.float64)
    adv = softmax_advantages(rewards, tau=0.2)
    shifted = softmax_advantages(rewards + torch.tensor([[5.0], [-3.0], [100.0]], dtype=torch.float64), tau=0.2)
    assert torch.allclose(adv, shifted, atol=1e-10)
    perm = torch.randperm(6)
    assert torch.allclose(softmax_advantages(rewards[:, perm], tau=0.2), adv[:, perm], atol=1e-6)


def test_softmax_constant_group_and_single_rollout():
    assert torch.equal(softmax_advantages(torch.full((2, 4), 0.7), tau=0.1), torch.zeros(2, 4))
    assert torch.equal(softmax_advantages(torch.tensor([[1.0], [0.0]]), tau=0.1), torch.zeros(2, 1))


def test_softmax_numerically_stable_and_at_least_float32():
    rewards = torch.tensor([[1e5, 0.0, -1e5, 1e5]], dtype=torch.bfloat16)
    adv = softmax_advantages(rewards, tau=0.1)  # r / tau up to 1e6
    assert adv.dtype == torch.float32
    assert torch.isfinite(adv).all()
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0]]))


@pytest.mark.parametrize(
    "tau, message",
    [
        ("0", "--tau must be finite and > 0"),
        ("-1", "--tau must be finite and > 0"),
        ("nan", "argument --tau: invalid number value: 'nan'"),
        ("inf", "argument --tau: invalid number value: 'inf'"),
    ],
)
def test_softmax_rejects_bad_tau(tau, message, capsys, tmp_path):
    """tau is checked once, at start (config.py, through hyperparameter_ranges), not on every call."""
    assert message in train_refuses(["--tau", tau], capsys, tmp_path)


def test_non_finite_reward_names_the_group():
    rewards = torch.zeros(3, 4)
    rewards[2, 1] = float("nan")
    for fn in ESTIMATORS.values():
        with pytest.raises(ValueError, match="group 2"):
            fn(rewards) if fn is not softmax_advantages else fn(rewards, tau=0.1)


@pytest.mark.parametrize("K", [1, 2, 5])
def test_low_temperature_limit_is_maxrl(K):
    M = 8
    rewards = torch.tensor([[1.0] * K + [0.0] * (M - K)])
    adv = softmax_advantages(rewards, tau=1e-3)
    expected = torch.tensor([[M / K - 1] * K + [-1.0] * (M - K)])
    assert torch.allclose(adv, expected, atol=1e-5)
    assert torch.allclose(adv, maxrl_advantages(rewards), atol=1e-5)


def test_high_temperature_limit_is_centered_reward_over_tau():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.3]])
    tau = 1e3
    adv = softmax_advantages(rewards.double(), tau=tau)
    expected = (rewards - rewards.mean()) / tau
    assert torch.allclose(adv.float() * tau, expected * tau, atol=1e-3)


def test_other_estimators_hand_values():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(drgrpo_advantages(r), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    # population std of {1, 0, 0, 1} is 0.5
    assert torch.allclose(grpo_advantages(r, eps=1e-12), torch.tensor([[1.0, -1.0, -1.0, 1.0]]))
    assert torch.equal(grpo_advantages(torch.ones(1, 4)), torch.zeros(1, 4))
    # others' mean for a success: 1/3; for a failure: 2/3
    assert torch.allclose(rloo_advantages(r), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    assert torch.allclose(maxrl_advantages(r), torch.tensor([[1.0, -1.0, -1.0, 1.0]]))
    assert torch.equal(maxrl_advantages(torch.zeros(1, 4)), torch.zeros(1, 4))
    batch = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # batch mean 0.5, group means 1 and 0
    assert torch.allclose(reinforce_advantages(batch), torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))


def test_compute_advantages_dispatch(capsys, tmp_path):
    r = torch.tensor([[1.0, 0.0]])
    assert torch.allclose(compute_advantages("softmax", r, tau=0.5), softmax_advantages(r, 0.5))
    assert torch.allclose(compute_advantages("grpo", r), grpo_advantages(r))
    with pytest.raises(KeyError, match="ppo"):  # a plain lookup: the command line refuses the name at start
        compute_advantages("ppo", r)
    message = f"--advantage must be one of {', '.join(ESTIMATORS)}"
    assert message in train_refuses(["--advantage", "ppo"], capsys, tmp_path)


P = torch.linspace(0.02, 0.98, 25, dtype=torch.float64)


@pytest.mark.parametrize("M", [4, 8, 16])
def test_population_weight_low_temperature_is_eq5(M):
    omega = population_weight("softmax", M, P, tau=1e-3)
    eq5 = (1 - (1 - P) ** (M - 1)) / P  # Eq. (5)
    assert omega.dtype == torch.float64 and omega.shape == P.shape
    assert torch.allclose(omega, eq5, rtol=1e-6)


@pytest.mark.parametrize("tau", [0.3, 1.0])
def test_population_weight_large_M_matches_table1(tau):
    c = math.exp(1 / tau)
    large_M = (c - 1) / (1 - P + P * c)  # Table 1, large-M form
    err = {M: ((population_weight("softmax", M, P, tau=tau) - large_M) / large_M).abs().max() for M in (500, 2000)}
    assert err[2000] < 1e-2 and err[2000] < err[500] / 3  # converges like 1/M
    grpo_err = ((population_weight("grpo", 2000, P) * torch.sqrt(P * (1 - P))) - 1).abs().max()
    assert grpo_err < 5e-3  # GRPO with the population std: 1 / sqrt(p (1 - p))


def test_population_weight_finite_M_softmax_matches_paper_w():
    # Section 3.3: w1_s = c / (M + (s+1)(c-1)), w0_s = 1 / (M + s(c-1)); A = M w - 1.
    M, tau, c = 8, 0.3, math.exp(1 / 0.3)
    s = torch.arange(M, dtype=torch.float64)
    gap = M * c / (M + (s + 1) * (c - 1)) - M / (M + s * (c - 1))
    p = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    pmf = torch.tensor(
        [[math.comb(M - 1, k) * q**k * (1 - q) ** (M - 1 - k) for k in range(M)] for q in p.tolist()],
        dtype=torch.float64,
    )
    assert torch.allclose(population_weight("softmax", M, p, tau=tau), (pmf * gap).sum(-1), rtol=1e-9)


def test_softmax_bounded_near_p1_while_grpo_blows_up():
    p = torch.tensor([0.9, 0.99, 0.999, 0.9999], dtype=torch.float64)
    soft = population_weight("softmax", 64, p, tau=0.1)
    grpo = population_weight("grpo", 4000, p)  # large M: the finite-M weight saturates near sqrt(M)
    assert (soft < 1.12).all() and (soft[1:] < soft[:-1]).all()  # tends to (c-1)/c ~ 1 as p -> 1
    assert (grpo[1:] > grpo[:-1]).all() and grpo[2] > 9 * grpo[0]  # ~ 1 / sqrt(1 - p)
    assert torch.allclose(population_weight("reinforce", 8, p), torch.ones_like(p))


def test_population_weight_monte_carlo_gradient():
    """E[sum_i A_i d/dtheta log pi(z_i)] = M * omega_M(p) * dp/dtheta for a Bernoulli(sigmoid(theta))."""
    g = torch.Generator().manual_seed(0)
    M, n_groups, theta = 8, 200_000, torch.tensor(-0.5, dtype=torch.float64)
    p = torch.sigmoid(theta)
    z = (torch.rand(n_groups, M, generator=g, dtype=torch.float64) < p).double()  # rewards = z
    score = z - p  # d/dtheta log pi(z) for the logit parameter
    for name, kw in [("softmax", {"tau": 0.3}), ("grpo", {}), ("rloo", {})]:
        adv = ESTIMATORS[name](z, **kw).double()
        per_group = (adv * score).sum(-1)  # (n_groups,)
        mc, se = per_group.mean(), per_group.std() / math.sqrt(n_groups)
        theory = M * population_weight(name, M, p, **kw) * p * (1 - p)  # dp/dtheta = p (1 - p)
        assert abs(mc - theory) < 4 * se, (name, float(mc), float(theory), float(se))


# ---------------------------------------------------------------- hyperparameters and stop-gradient
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimators_return_constants(name):
    """Advantages are constants in Eq. (10): no gradient may flow back into rewards that carry one."""
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.9, 0.1]], requires_grad=True)
    adv = compute_advantages(name, rewards * 2)  # a non-leaf with gradient history
    assert not adv.requires_grad and adv.grad_fn is None
    assert torch.equal(adv, compute_advantages(name, rewards.detach() * 2))


@pytest.mark.parametrize(
    "tau",
    [
        0.3,
        1,
        np.float32(0.3),
        np.float64(0.3),
        np.int64(2),
        torch.tensor(0.3),
        torch.tensor([0.3], dtype=torch.float64),
    ],
)
def test_softmax_accepts_real_scalar_tau(tau):
    """The start-time check takes any one real number, and the estimator gives what float(tau) gives."""
    assert hyperparameter_ranges()["tau"].problem(tau) is None
    r = torch.tensor([[1.0, 0.0, 0.0]])
    adv = softmax_advantages(r, tau=tau).float()  # a float64 one-element tensor promotes the division
    assert torch.allclose(adv, softmax_advantages(r, tau=float(tau)), atol=1e-6)


@pytest.mark.parametrize(
    "tau, message",
    [
        (True, "one real number"),
        ("0.3", "one real number"),
        (None, "one real number"),
        (np.bool_(True), "one real"),
        (torch.tensor([0.3, 0.2]), "one real number"),
        (torch.tensor(True), "one real number"),
        (float("nan"), "finite and > 0"),
        (float("-inf"), "finite and > 0"),
        (0, "finite and > 0"),
        (torch.tensor(-0.1), "finite and > 0"),
    ],
)
def test_softmax_refuses_tau_with_a_true_message(tau, message):
    """The one check of tau, config.py's at start (hyperparameter_ranges), names what is wrong with the value."""
    assert message in hyperparameter_ranges()["tau"].problem(tau)


def test_estimator_params_lists_every_declared_hyperparameter():
    params = estimator_params()
    assert params["tau"] == (0.1, float)
    assert params["eps"] == (1e-6, float)  # grpo's and maxrl's, one shared flag
    assert params["baseline"] == (None, float)  # float | None -> float for the flag


def test_compute_advantages_passes_each_estimator_its_own_hyperparameters():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    every = {"tau": 0.5, "eps": 0.25, "baseline": 0.1}  # what train.py passes: all of them, to any estimator
    assert torch.allclose(compute_advantages("softmax", r, **every), softmax_advantages(r, tau=0.5))
    assert torch.allclose(compute_advantages("grpo", r, **every), grpo_advantages(r, eps=0.25))
    assert not torch.allclose(grpo_advantages(r, eps=0.25), grpo_advantages(r))  # eps really reached it
    assert torch.allclose(compute_advantages("reinforce", r, **every), r - 0.1)
    assert torch.allclose(compute_advantages("softmax", r, 0.5), softmax_advantages(r, tau=0.5))  # positional tau


def test_an_unknown_hyperparameter_is_refused_at_the_command_line(capsys, tmp_path):
    """Each hyperparameter is a flag (estimator_params), so a misspelt one never reaches compute_advantages."""
    assert "unrecognized arguments: --taus 0.5" in train_refuses(["--taus", "0.5"], capsys, tmp_path)


def test_a_new_estimator_with_a_hyperparameter_is_one_edit(monkeypatch):
    def power_advantages(rewards, alpha: float = 2.0):
        rewards = rewards.detach().float()
        return rewards**alpha - (rewards**alpha).mean(-1, keepdim=True)

    monkeypatch.setitem(ESTIMATORS, "power", power_advantages)
    assert estimator_params()["alpha"] == (2.0, float)
    r = torch.tensor([[1.0, 0.5, 0.0]])
    assert torch.allclose(compute_advantages("power", r, tau=0.3, alpha=3.0), r**3 - (r**3).mean())
    assert torch.isfinite(population_weight("power", 4, torch.tensor([0.5]), alpha=1.0)).all()


def test_conflicting_hyperparameter_defaults_are_refused(monkeypatch):
    monkeypatch.setitem(ESTIMATORS, "other", lambda rewards, tau=0.7: rewards)
    with pytest.raises(ValueError, match="'tau' defaults to 0.7"):
        estimator_params()


@pytest.mark.parametrize(
    "name, value",
    [
        ("eps", -1.0),
        ("eps", 0.0),
        ("eps", float("nan")),
        ("eps", float("inf")),
        ("eps", 1e-300),
        ("tau", 1e-300),
        ("tau", -0.1),
        ("baseline", float("nan")),
        ("baseline", float("inf")),
        ("baseline", "0.5"),
    ],
)
def test_every_estimator_refuses_a_hyperparameter_outside_its_declared_range(name, value, tmp_path):
    """eps -1 would flip GRPO's advantages; eps or tau that round to 0 in float32 would make them NaN. The one
    check, at start, refuses each whichever estimator trains (every hyperparameter reaches the run's log)."""
    valid = hyperparameter_ranges()[name]
    assert valid.problem(value) is not None
    users = [est for est, fn in ESTIMATORS.items() if name in hyperparameters(fn)]
    assert users
    for est in users if isinstance(value, float) else []:  # what a flag can hold; "0.5": the range alone
        error = check_args(Args(advantage=est, out_dir=str(tmp_path / "run"), **{name: value}))
        assert error.startswith(f"--{name} must be") and "\n" not in error, error


def test_declared_ranges_accept_the_defaults_and_small_float32_values():
    ranges = hyperparameter_ranges()
    assert set(ranges) == set(estimator_params())
    for name, (default, _) in estimator_params().items():
        assert ranges[name].problem(default) is None
    assert ranges["tau"].problem(1e-30) is None and ranges["baseline"].problem(None) is None
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    assert torch.isfinite(softmax_advantages(r, tau=1e-30)).all()  # the smallest accepted values stay finite
    assert torch.isfinite(grpo_advantages(torch.ones(1, 4), eps=torch.finfo(torch.float32).tiny)).all()


# ---------------------------------------------------------------- invariants over random rewards in each domain
# each estimator states its own reward domain (advantage.holds_for_rewards_at_least)
REWARD_FLOOR = {name: fn.reward_floor for name, fn in ESTIMATORS.items() if hasattr(fn, "reward_floor")}


def random_rewards(name: str, M: int, seed: int) -> list[torch.Tensor]:
    """(64, M) groups in `name`'s reward domain: binary, continuous in [0, 1], and signed where it takes any real."""
    gen = torch.Generator().manual_seed(seed)
    rewards = [torch.randint(0, 2, (64, M), generator=gen).float(), torch.rand(64, M, generator=gen)]
    return rewards if name in REWARD_FLOOR else rewards + [4 * torch.rand(64, M, generator=gen) - 2]


def bound(name: str, M: int, rewards: torch.Tensor) -> torch.Tensor:
    """The largest |A| (or, for softmax and maxrl, the interval) each group's advantages may reach, (G, 1) each."""
    spread = rewards.amax(-1, keepdim=True) - rewards.amin(-1, keepdim=True)  # (G, 1)
    return {  # derived next to each: every bound is reached by some group, so none is loose by construction
        "softmax": (-1, M - 1),  # A = M w - 1 with softmax weights w in (0, 1)
        "maxrl": (-1, M - 1),  # R >= 0: A = R / mean - 1 >= -1, and R <= M mean, so A <= M - 1 (0 when mean <= eps)
        "grpo": math.sqrt(M - 1),  # a z-score with the population std is at most sqrt(M - 1) (Samuelson)
        "drgrpo": spread * (M - 1) / M,  # R - mean, the mean within [min, max] at least (max - min) / M from R
        "rloo": spread,  # R - mean of the others = M / (M - 1) (R - mean): at most max - min
        "reinforce": rewards.amax() - rewards.amin(),  # R - batch mean: at most the batch's range
    }.get(name, math.inf)  # a new estimator: finite advantages, its own bound stated here when it has one


@pytest.mark.parametrize("M", [2, 3, 8, 16, 64])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_every_estimator_keeps_its_sums_order_and_bounds_over_random_rewards(name, M):
    """Over seeded rewards in the estimator's domain, for each group: advantages sum to zero (REINFORCE: over the
    batch, and to the rewards' sum less M x baseline with a constant one), a higher reward never gets a lower
    advantage, and |A| stays within the estimator's bound. Float32 on rewards of at most 2 in size: 1e-5 relative."""
    for seed in range(3):
        for rewards in random_rewards(name, M, seed):
            adv = compute_advantages(name, rewards)  # (G, M)
            scale = 1e-5 * (1 + adv.abs().amax())  # rounding of float32 sums of M terms of this size
            assert torch.isfinite(adv).all() and adv.shape == rewards.shape
            sums = adv.sum() if name == "reinforce" else adv.sum(-1)  # batch-mean baseline: zero over the batch
            assert sums.abs().max() <= M * scale, (name, M, sums.abs().max())
            if name == "reinforce":
                constant = compute_advantages(name, rewards, baseline=0.25).sum(-1)  # (G,)
                assert torch.allclose(constant, rewards.sum(-1) - M * 0.25, atol=M * scale)
            higher = rewards[:, :, None] > rewards[:, None, :]  # (G, M, M): R_i > R_j
            lower = adv[:, :, None] < adv[:, None, :] - scale  # A_i < A_j beyond rounding
            assert not (higher & lower).any(), (name, M)
            limit = bound(name, M, rewards)
            low, high = limit if isinstance(limit, tuple) else (-limit, limit)
            assert (adv >= low - scale).all() and (adv <= high + scale).all(), (name, M, adv.min(), adv.max())


@pytest.mark.parametrize("name", list(REWARD_FLOOR))
def test_an_estimator_refuses_rewards_below_its_floor_by_name(name, capsys, tmp_path):
    """MaxRL's (R - mean) / mean flipped every sign for a penalty (exact=-1) and reached +-4,000 with mixed-sign
    weights (exact=1,format=-0.9); the one check, at start (config.py, from the declared floor), refuses any
    --reward-weights that could give a reward below the estimator's floor, so no step sees one."""
    floor = REWARD_FLOOR[name]
    for weights, least in (("exact=1,format=-0.9", -0.9), ("exact=-1", -1.0)):  # mixed signs; a penalty
        flags = ["--plan", "--plan-gpus", "1", "--advantage", name, "--reward-weights", weights]
        expected = f"--advantage {name}, which holds for rewards >= {floor:g}, but --reward-weights {weights} gives "
        assert expected + f"rewards down to {least:g}" in train_refuses(flags, capsys, tmp_path)
    assert torch.isfinite(ESTIMATORS[name](torch.full((2, 4), floor))).all()  # the floor itself is in
    assert "maxrl" in REWARD_FLOOR  # MaxRL divides by the group mean


# ---------------------------------------------------------------- GDPO, against values worked by hand
def test_gdpo_keeps_apart_the_reward_mixes_that_grpo_collapses():
    """Two binary terms, M = 2. GRPO on the sums [1, 0] and [2, 0] gives both groups [1, -1]; GDPO z-scores each
    term in its group (group 1: [1, -1] + 0; group 2: [1, -1] + [1, -1]), so the totals are [1, -1] and [2, -2],
    and the batch step divides by their population std, sqrt(10 / 4)."""
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    terms = {"exact": (1.0, a), "format": (1.0, b)}
    adv = compute_advantages("gdpo", a + b, terms=terms, eps=1e-12)
    expected = torch.tensor([[1.0, -1.0], [2.0, -2.0]], dtype=torch.float64) / math.sqrt(2.5)
    assert torch.allclose(adv, expected, atol=1e-9)
    grpo = compute_advantages("grpo", a + b, eps=1e-12)
    assert torch.allclose(grpo[0], grpo[1], atol=1e-9)  # the collapse GDPO undoes


def test_gdpo_weights_each_terms_group_z_score():
    """One group of 4: z(a) = [1, 1, -1, -1]; b = [1, 0, 0, 0] has mean 1/4 and std sqrt(3) / 4, so
    z(b) = [sqrt(3), -1/sqrt(3), -1/sqrt(3), -1/sqrt(3)]. With weights 1 and 0.5 the total is z(a) + z(b) / 2,
    and its batch z-score (mean 0 already) divides by the root mean square."""
    a = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    r3 = math.sqrt(3)
    total = [1 + r3 / 2, 1 - 1 / (2 * r3), -1 - 1 / (2 * r3), -1 - 1 / (2 * r3)]
    rms = math.sqrt(sum(t * t for t in total) / 4)
    expected = torch.tensor([[t / rms for t in total]], dtype=torch.float64)
    adv = gdpo_advantages(a + 0.5 * b, eps=1e-12, terms={"a": (1.0, a), "b": (0.5, b)})
    assert torch.allclose(adv, expected, atol=1e-9)
    assert "terms" not in hyperparameters(gdpo_advantages)  # a step input, not a flag
