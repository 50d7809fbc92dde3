"""tools/power.py against scipy's noncentral t and the normal-approximation formula."""

import math

import pytest

from tools.power import pairs_needed, power


def test_power_is_close_to_the_noncentral_t():
    stats = pytest.importorskip("scipy.stats")
    for n, sd, effect in [(5, 0.05, 0.05), (10, 0.05, 0.023), (40, 0.1, 0.05), (20, 0.2, 0.07)]:
        crit = stats.t.ppf(0.975, n - 1)
        nc = effect * math.sqrt(n) / sd
        exact = 1 - stats.nct.cdf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc)
        assert power(n, sd, effect) == pytest.approx(exact, abs=2e-3), (n, sd, effect)


def test_pairs_needed_is_the_first_n_reaching_the_target_and_near_the_normal_formula():
    n = pairs_needed(0.05, 0.023)
    assert power(n, 0.05, 0.023) >= 0.8 > power(n - 1, 0.05, 0.023)
    normal = ((1.959964 + 0.841621) * 0.05 / 0.023) ** 2  # z-test: t needs a pair or two more
    assert normal <= n <= normal + 3
    assert pairs_needed(1.0, 1e-4, most=1000) == 1001  # out of reach says so
