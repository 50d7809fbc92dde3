"""Table 3 on fresh rollouts: sample a model on a task, then print each estimator's gradient budget share per
pass-rate bin (grad_alloc.py computes the allocation; this is its command line).

    python -m tools.grad_alloc --model smollm2-135m --task arith --prompts 32 --M 8    # Table 3 layout
    python -m tools.grad_alloc --model smollm2-135m --task arith --prompts 8 --exact   # + cheap vs exact (slow on CPU)

`--exact` also measures each prompt's real gradient norm with a backward pass (small models) and prints its
Pearson and Spearman agreement with the cheap budget sum_i |A_i| len_i.
"""

import sys

import torch

from advantage import ESTIMATORS, compute_advantages, estimator_params, hyperparameter_ranges
from grad_alloc import BINS, allocation_by_estimator, bin_index, pass_rates_of, prompt_budgets, shares_by_bin
from plumbing.cli import OneLineParser
from speed.logprobs import pad_batch, sequence_logprobs


def exact_prompt_grad_norms(model, prompts, completions, adv, pad_id, temperature=1.0) -> torch.Tensor:
    """(G,) norms ||grad L_g||, L_g = sum_i A_gi sum_t logp_git / N: prompt g's share of the step at theta_old."""
    n_tokens = sum(len(c) for group in completions for c in group)  # N: the batch's token-mean denominator
    norms = torch.zeros(len(prompts), dtype=torch.float64)  # (G,)
    params = [q for q in model.parameters() if q.requires_grad]
    for g, (prompt, group) in enumerate(zip(prompts, completions)):
        if not adv[g].abs().sum() > 0:  # no advantage, no gradient: skip the backward pass
            continue
        input_ids, attention_mask, mask = pad_batch([prompt] * len(group), group, pad_id)
        logp = sequence_logprobs(model, input_ids, attention_mask, mask.shape[1], temperature)  # (M, K)
        loss = (torch.as_tensor(adv[g]).float() * (logp * mask).sum(-1)).sum() / n_tokens
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        norms[g] = torch.sqrt(sum((gr.double() ** 2).sum() for gr in grads if gr is not None))
    return norms


def agreement(cheap, exact) -> dict[str, float]:
    """Pearson and Spearman correlation of two per-prompt budgets, leaving out prompts that are 0 in both."""
    cheap, exact = torch.as_tensor(cheap).double(), torch.as_tensor(exact).double()
    keep = (cheap != 0) | (exact != 0)
    x, y = cheap[keep], exact[keep]

    def pearson(a, b):
        a, b = a - a.mean(), b - b.mean()
        denom = a.norm() * b.norm()
        return float((a @ b) / denom) if len(a) > 1 and denom > 0 else float("nan")

    def ranks(a):  # average ranks, so ties get the same rank
        return torch.tensor([(a < v).sum().item() + ((a == v).sum().item() - 1) / 2 for v in a], dtype=torch.float64)

    return {"pearson": pearson(x, y), "spearman": pearson(ranks(x), ranks(y)), "prompts": int(keep.sum())}


def format_table(rows: dict[str, list[float]], counts: list[int] | None = None) -> str:
    header = f"{'method':<12}" + "".join(f"{f'[{lo:g},{hi:g}' + (']' if hi == 1 else ')'):>11}" for lo, hi in BINS)
    lines = [header] + ([f"{'prompts':<12}" + "".join(f"{c:>11d}" for c in counts)] if counts else [])
    return "\n".join(lines + [f"{name:<12}" + "".join(f"{s:>10.1f}%" for s in row) for name, row in rows.items()])


def main(argv=None):
    parser = OneLineParser(
        "grad_alloc.py", description="Table 3: gradient budget share per pass-rate bin, on fresh rollouts."
    )
    parser.add_argument("--model", required=True, help="HF folder, checkpoint folder or alias")
    parser.add_argument("--task", required=True)
    parser.add_argument("--data-file", default=None)
    parser.add_argument("--prompts", type=int, default=32, help="number of prompts G")
    parser.add_argument("--M", type=int, default=8, help="rollouts per prompt")
    for name, (default, kind) in estimator_params().items():  # --tau, --eps, ...: whatever the estimators declare
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=default,
            help=f"estimator hyperparameter (advantage.py), default {default}",
        )
    parser.add_argument("--estimators", default="grpo,softmax", help="comma-separated names from advantage.py")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sampler", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--exact", action="store_true", help="also measure per-prompt gradient norms (small models)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    names = args.estimators.split(",")
    hparams = {name: getattr(args, name) for name in estimator_params()}
    if any(n not in ESTIMATORS for n in names) or args.prompts < 1 or args.M < 2:
        parser.error(f"--estimators must be among {sorted(ESTIMATORS)}, --prompts >= 1, --M >= 2")
    for name, valid in hyperparameter_ranges().items():  # the estimators no longer check per call: train.py's door
        problem = valid.problem(getattr(args, name))
        if problem is not None:
            parser.error(f"--{name.replace('_', '-')} {problem}")

    from rollout import make_sampler, resolve_model
    from tasks import encode_prompts, get_task

    task = get_task(args.task)
    kind = "exact" if task.has_verifier else "sim"  # no verifier: similarity reward (Appendix B.5)
    examples = task.load("train", data_file=args.data_file, limit=args.prompts, seed=args.seed)
    sampler = make_sampler(
        args.sampler, args.model, dtype="bfloat16" if args.sampler == "hf" else "auto", seed=args.seed
    )
    prompts = encode_prompts(sampler.tokenizer, examples)
    groups = sampler.generate(prompts, n=args.M, max_tokens=args.max_tokens, temperature=1.0, seed=args.seed)
    pad_id = sampler.tokenizer.pad_token_id or 0
    sampler.close()
    rewards = torch.tensor(
        [[task.reward(c.text, ex, kind=kind) for c in group] for ex, group in zip(examples, groups)]
    )  # (G, M)
    lengths = torch.tensor([[len(c.token_ids) for c in group] for group in groups])  # (G, M)
    p = pass_rates_of(rewards)
    counts = [sum(bin_index(x) == b for x in p.tolist()) for b in range(len(BINS))]
    print(
        f"{args.task}: {len(examples)} prompts x {args.M} rollouts, mean reward {rewards.mean():.3f}, "
        f"{hparams}\ncheap budget sum_i |A_i| len_i:"
    )
    print(format_table(allocation_by_estimator(rewards, lengths, names, **hparams), counts))
    if args.exact:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).eval()
        completions = [[c.token_ids for c in group] for group in groups]
        exact_rows = {}
        print("cheap vs exact budget per prompt (one backward pass per prompt and estimator):", flush=True)
        for name in names:
            adv = compute_advantages(name, rewards, **hparams)  # (G, M)
            norms = exact_prompt_grad_norms(model, prompts, completions, adv, pad_id)
            exact_rows[name] = shares_by_bin(p, norms)
            a = agreement(prompt_budgets(adv, lengths), norms)
            print(
                f"  {name}: pearson {a['pearson']:.3f}, spearman {a['spearman']:.3f} over {a['prompts']} prompts",
                flush=True,
            )
        print("exact per-prompt gradient norms:\n" + format_table(exact_rows, counts))


if __name__ == "__main__":
    from plumbing.data import DataError
    from plumbing.models import ModelLoadError, SamplingError

    try:
        main()
    except (DataError, ModelLoadError, SamplingError) as err:  # one line, as train.py and eval.py
        sys.exit(f"grad_alloc.py: error: {err}")
