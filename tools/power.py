"""Power of a paired comparison (docs/study.md): how many paired seeds detect an effect, and what a study achieved.

For paired differences d_1..d_n with SD sigma, a two-sided paired t-test at level alpha detects a true mean
difference `effect` with probability power(n) = P(|T| > t_{1-alpha/2, n-1}), T noncentral t with n - 1 degrees of
freedom and noncentrality effect sqrt(n) / sigma; the pairs needed for a target power are the smallest such n.

    python -m tools.power --sd 0.05 --effect 0.023            # pairs for 80% power at alpha 0.05
    python -m tools.power --sd 0.05 --effect 0.023 --pairs 10  # the power 10 pairs give
"""

import math

from plumbing.cli import OneLineParser
from tools.sweep import t_quantile


def power(n: int, sd: float, effect: float, alpha: float = 0.05) -> float:
    """Probability that n paired seeds with difference SD `sd` reject 'no difference' when the truth is `effect`:
    P(|T| > c) for T noncentral t with n - 1 degrees of freedom and noncentrality effect sqrt(n) / sd, written as
    E_V[Phi(delta - c s) + Phi(-delta - c s)] with s = sqrt(V / df), V ~ chi^2_df, by Simpson's rule over V."""
    if n < 2:
        return 0.0
    df, delta = n - 1, abs(effect) * math.sqrt(n) / sd
    c = t_quantile(1 - alpha / 2, df)
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    log_norm = -(df / 2) * math.log(2) - math.lgamma(df / 2)
    top, panels = df + 40 * math.sqrt(df) + 40, 4000
    h = top / panels

    def f(v):
        if v <= 0:
            return 0.0
        density = math.exp(log_norm + (df / 2 - 1) * math.log(v) - v / 2)  # chi^2_df
        s = math.sqrt(v / df)
        return density * (phi(delta - c * s) + phi(-delta - c * s))

    return h / 3 * (f(0) + f(top) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, panels)))


def pairs_needed(sd: float, effect: float, target: float = 0.8, alpha: float = 0.05, most: int = 100_000) -> int:
    """The fewest pairs with power >= target (most + 1 when even `most` pairs fall short)."""
    lo, hi = 2, most
    if power(hi, sd, effect, alpha) < target:
        return most + 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if power(mid, sd, effect, alpha) < target else (lo, mid)
    return lo


def main(argv=None):
    parser = OneLineParser("python -m tools.power", description=__doc__.splitlines()[0])
    parser.add_argument("--sd", type=float, required=True, help="SD of the paired differences (a pilot's)")
    parser.add_argument("--effect", type=float, required=True, help="the difference to detect")
    parser.add_argument("--pairs", type=int, help="report the power of this many pairs instead")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--target", type=float, default=0.8)
    opts = parser.parse_args(argv)
    if not (opts.sd > 0 and opts.effect != 0 and 0 < opts.alpha < 1 and 0 < opts.target < 1):
        parser.error("--sd must be > 0, --effect nonzero, --alpha and --target in (0, 1)")
    if opts.pairs:
        print(f"power of {opts.pairs} pairs: {power(opts.pairs, opts.sd, opts.effect, opts.alpha):.3f}")
    else:
        print(f"pairs for {opts.target:.0%} power: {pairs_needed(opts.sd, opts.effect, opts.target, opts.alpha)}")


if __name__ == "__main__":
    main()
