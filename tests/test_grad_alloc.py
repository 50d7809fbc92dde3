"""grad_alloc.py: Table 3 shares on hand-built groups; tools/grad_alloc.py: the cheap budget against real gradient
norms, and its command line."""

import math

import pytest
import torch

import advantage
import grad_alloc
from grad_alloc import (
    BIN_LABELS,
    BINS,
    allocation_by_estimator,
    allocation_metrics,
    allocation_table,
    bin_index,
    prompt_budgets,
)
from tools.grad_alloc import agreement, exact_prompt_grad_norms, main

M = 4
# One group per pass rate 0, 1/4, 1/2, 3/4, 1 (binary rewards, s successes out of M).
REWARDS = torch.tensor([[float(i < s) for i in range(M)] for s in range(M + 1)])  # (5, 4)
LENGTHS = torch.full((M + 1, M), 10.0)  # (5, 4)


def test_bin_edges():
    ps = (0, 0.1999, 0.2, 0.49, 0.5, 0.7, 0.89, 0.9, 0.99, 1.0)
    assert [bin_index(p) for p in ps] == [0, 0, 1, 1, 2, 3, 3, 4, 4, 4]
    # a float32 pass rate of 7/10 is 0.69999999; it is still 0.7
    assert bin_index(torch.tensor(7 / 10, dtype=torch.float32).item()) == 3
    assert len(BINS) == len(BIN_LABELS) == 5


def test_grpo_shares_by_hand():
    # GRPO's |A| mass of a binary group is sum |r - p| / sqrt(p(1-p)) = 2 M sqrt(p(1-p)): 4 at p = 1/2,
    # 2 sqrt(3) at p = 1/4 and 3/4, and 0 for the all-fail and all-pass groups.
    shares = allocation_by_estimator(REWARDS, LENGTHS, ["grpo"])["grpo"]
    total = 4 + 4 * math.sqrt(3)
    expected = [0.0, 100 * 2 * math.sqrt(3) / total, 100 * 4 / total, 100 * 2 * math.sqrt(3) / total, 0.0]
    assert shares == pytest.approx(expected, rel=1e-4)
    assert sum(shares) == pytest.approx(100.0)


def test_softmax_shares_by_hand():
    # SoftmaxGRPO with s successes: A_0 = M / (s c + M - s) - 1 for each of the M - s failures, c = e^(1/tau);
    # advantages sum to zero, so the |A| mass is twice the failures' mass.
    tau = 0.3
    c = math.exp(1 / tau)
    mass = [2 * (M - s) * (1 - M / (s * c + M - s)) for s in range(M + 1)]
    assert mass[0] == mass[M] == 0  # all-fail and all-pass groups carry no gradient
    expected = [100 * x / sum(mass) for x in mass]  # p = 0, .25, .5, .75, 1 land in bins 0..4 in turn
    shares = allocation_by_estimator(REWARDS, LENGTHS, ["softmax"], tau=tau)["softmax"]
    assert shares == pytest.approx(expected, rel=1e-4, abs=1e-9)
    # Table 3's qualitative finding: less budget on near-solved prompts than GRPO, on the same groups
    # (here p = 3/4 is the easiest prompt with a gradient).
    grpo = allocation_by_estimator(REWARDS, LENGTHS, ["grpo"])["grpo"]
    assert shares[3] < grpo[3] and shares[1] > grpo[1]


def test_lengths_weight_the_budget_and_rows_sum_to_100():
    pass_rates = torch.tensor([0.1, 0.95])
    adv = torch.tensor([[1.0, -1.0], [0.5, -0.5]])  # |A| mass 2 and 1
    lengths = torch.tensor([[10, 10], [40, 40]])  # ... times the tokens: 20 and 40
    assert prompt_budgets(adv, lengths).tolist() == [20.0, 40.0]
    shares = allocation_table(pass_rates, adv, lengths)
    assert shares == pytest.approx([100 / 3, 0, 0, 0, 200 / 3])
    rows = allocation_by_estimator(
        torch.rand(16, 8).round(),
        torch.randint(1, 50, (16, 8)),
        ["grpo", "softmax", "drgrpo", "rloo", "maxrl", "reinforce"],
    )
    for row in rows.values():
        assert sum(row) == pytest.approx(100.0) and all(0 <= s <= 100 for s in row)


def test_no_budget_gives_zeros_not_nan():
    assert allocation_table(torch.tensor([0.0, 1.0]), torch.zeros(2, 4), torch.ones(2, 4)) == [0.0] * 5
    metrics = allocation_metrics(torch.ones(3, 4), torch.ones(3, 4), ["grpo", "softmax"])
    assert len(metrics) == 10 and all(v == 0.0 for v in metrics.values())
    assert "alloc/softmax/0.9-1" in metrics


def test_agreement_by_hand():
    # monotone but not linear: Spearman 1, Pearson below 1; a prompt that is 0 in both is left out
    a = agreement([0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 4.0, 9.0])
    assert a["prompts"] == 3 and a["spearman"] == pytest.approx(1.0) and 0.9 < a["pearson"] < 1.0
    assert agreement([1.0, 2.0, 2.0], [3.0, 1.0, 1.0])["spearman"] == pytest.approx(-1.0)  # ties averaged
    assert math.isnan(agreement([1.0, 1.0], [2.0, 3.0])["pearson"])


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def test_exact_norms_proportional_case(model_and_tokenizer):
    # Every group holds the same prompt and completions with advantages a_g * (1, -1, 2): the exact
    # gradient norm is then |a_g| * (a fixed norm), the cheap budget |a_g| * (a fixed mass).
    model, tok = model_and_tokenizer
    prompt, group = tok.encode("Q: 1+1?"), [tok.encode("A 2"), tok.encode("two!"), tok.encode("x")]
    scale = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0])
    adv = scale[:, None] * torch.tensor([1.0, -1.0, 2.0])  # (5, 3)
    lengths = torch.tensor([[len(c) for c in group]] * 5)  # (5, 3)
    norms = exact_prompt_grad_norms(model, [prompt] * 5, [group] * 5, adv, tok.pad_token_id)
    assert norms[3] == 0 and (norms[[0, 1, 2, 4]] > 0).all()
    ratio = norms[[0, 1, 2, 4]] / scale[[0, 1, 2, 4]].abs().double()
    assert torch.allclose(ratio, ratio[0].expand(4), rtol=1e-4)
    a = agreement(prompt_budgets(adv, lengths), norms)
    assert a["pearson"] == pytest.approx(1.0, abs=1e-6) and a["spearman"] == pytest.approx(1.0)
    p = torch.tensor([0.1, 0.3, 0.6, 0.8, 0.95])
    from grad_alloc import shares_by_bin

    assert shares_by_bin(p, norms) == pytest.approx(allocation_table(p, adv, lengths), rel=1e-4)


def test_exact_norms_match_a_direct_backward(model_and_tokenizer):
    # Cross-check one prompt's norm against loss.policy_loss at ratio 1 (token-mean over the batch).
    from loss import policy_loss
    from speed.logprobs import pad_batch, sequence_logprobs

    model, tok = model_and_tokenizer
    torch.manual_seed(0)
    prompts = [tok.encode("What is 3+4?"), tok.encode("Hi")]
    completions = [[tok.encode(s) for s in ("7", "It is 7.", "eight")], [tok.encode(s) for s in ("hello", "yo", "")]]
    adv = torch.randn(2, 3)
    norms = exact_prompt_grad_norms(model, prompts, completions, adv, tok.pad_token_id)
    n_tokens = sum(len(c) for g in completions for c in g)
    ids, attn, mask = pad_batch([prompts[0]] * 3, completions[0], tok.pad_token_id)
    logp = sequence_logprobs(model, ids, attn, mask.shape[1])
    loss, _ = policy_loss(logp, logp.detach(), adv[0], mask, denominator=n_tokens, beta=0.0)
    model.zero_grad()
    loss.backward()
    direct = torch.sqrt(sum((q.grad.double() ** 2).sum() for q in model.parameters() if q.grad is not None))
    model.zero_grad()
    assert norms[0].item() == pytest.approx(direct.item(), rel=1e-4)
    a = agreement(prompt_budgets(adv, torch.tensor([[len(c) for c in g] for g in completions])), norms)
    assert a["prompts"] == 2 and abs(a["pearson"]) == pytest.approx(1.0)  # two points: correlation is +-1


def test_cli_prints_table(tiny_model_dir, capsys):
    main(
        [
            "--model",
            tiny_model_dir,
            "--task",
            "arith",
            "--prompts",
            "3",
            "--M",
            "2",
            "--max-tokens",
            "3",
            "--estimators",
            "grpo,softmax,rloo",
            "--exact",
        ]
    )
    out = capsys.readouterr().out
    assert "[0.9,1]" in out and out.count("\nsoftmax ") == 2 and out.count("\nrloo ") == 2
    assert "spearman" in out


def test_pass_rates_override():
    # similarity rewards all below 0.5 count as no passes; explicit verifier pass rates re-bin the prompts
    rewards, lengths = torch.tensor([[0.2, 0.4], [0.1, 0.3]]), torch.ones(2, 2)
    assert allocation_by_estimator(rewards, lengths, ["drgrpo"])["drgrpo"] == pytest.approx([100, 0, 0, 0, 0])
    shares = allocation_by_estimator(rewards, lengths, ["drgrpo"], pass_rates=torch.tensor([0.0, 1.0]))["drgrpo"]
    assert shares == pytest.approx([50, 0, 0, 0, 50])


def test_allocation_forwards_every_estimator_hyperparameter():
    """Not only tau: grpo's eps reaches it, so a new estimator's hyperparameter would too."""
    rewards, lengths = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]), torch.ones(2, 4)  # std 0.433, 0.5
    # grpo budgets sum_i |A_i| = 1.5 / (0.433 + eps) and 2 / (0.5 + eps): 46.4% / 53.6% at eps -> 0, 43.0% / 57.0% at 10
    small_eps = allocation_by_estimator(rewards, lengths, ["grpo"], eps=1e-6)["grpo"]
    big_eps = allocation_by_estimator(rewards, lengths, ["grpo"], eps=10.0)["grpo"]
    assert small_eps[1:3] == pytest.approx([46.4, 53.6], abs=0.1)
    assert big_eps[1:3] == pytest.approx([43.0, 57.0], abs=0.1)
    metrics = allocation_metrics(rewards, lengths, ["grpo", "softmax"], eps=10.0, tau=0.3)
    assert metrics["alloc/grpo/0.2-0.5"] == pytest.approx(big_eps[1])
    assert metrics["alloc/softmax/0.2-0.5"] != pytest.approx(
        allocation_metrics(rewards, lengths, ["softmax"], tau=3.0)["alloc/softmax/0.2-0.5"]
    )


def test_cli_offers_one_flag_per_estimator_hyperparameter(capsys):
    with pytest.raises(SystemExit):  # --eps and --tau parse; the bad estimator name stops it
        main(["--model", "x", "--task", "arith", "--estimators", "nope", "--eps", "0.5", "--tau", "0.2"])
    assert "--estimators must be among" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "x", "--task", "arith", "--alpha", "0.5"])
    assert "unrecognized arguments: --alpha" in capsys.readouterr().err


def test_an_estimator_that_raises_is_left_out_unless_it_is_trained(monkeypatch, capsys):
    """A broken estimator a fork adds stops no run that trains another one; the one being trained raises."""

    def broken_advantages(rewards):
        raise ValueError("broken_advantages: not implemented yet\nsecond line")

    monkeypatch.setitem(advantage.ESTIMATORS, "broken", broken_advantages)
    monkeypatch.setattr(grad_alloc, "_warned", set())
    rewards, lengths = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.ones(2, 2)
    for _ in range(2):  # as train.py does on every step
        metrics = allocation_metrics(rewards, lengths, ["grpo", "broken", "softmax"], must="softmax", tau=0.3)
    assert "alloc/grpo/0.5-0.7" in metrics and "alloc/softmax/0.5-0.7" in metrics
    assert not any(key.startswith("alloc/broken/") for key in metrics)
    assert metrics == allocation_metrics(rewards, lengths, ["grpo", "softmax"], tau=0.3)  # the others unchanged
    err = capsys.readouterr().err
    assert err.count("'broken'") == 1 and "not implemented yet" in err and "second line" not in err  # once, 1 line
    with pytest.raises(ValueError, match="not implemented yet"):
        allocation_metrics(rewards, lengths, ["grpo", "broken"], must="broken")
    assert allocation_metrics(rewards, lengths, ["drgrpo"]).keys() == {f"alloc/drgrpo/{b}" for b in BIN_LABELS}
