"""The "Fork it" recipes (docs/fork.md, listed in the README), applied exactly as written to a copy of the repository.

Each code block below is docs/fork.md's, character for character (test_docs_show_exactly_this_code checks it).
The `fork` fixture copies the repository and appends each block to the stage file the page names, which is what
pasting it below the registry does; nothing in this checkout changes. In the copy, with all the recipes at once:
each recipe does what it says (a script run there), the whole fast suite stays green (so tests check what a
registry contains, never that it equals a list), and train.py trains two steps with every new flag, then eval.py
scores the new task with its new reward term.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.test_reward_model import build_classifier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ESTIMATOR = '''\
def floorgrpo_advantages(rewards: torch.Tensor, std_floor: float = 0.1) -> torch.Tensor:
    """GRPO with the group std floored at std_floor, so near-constant groups are not blown up."""
    rewards = _as_groups(rewards, "floorgrpo_advantages")
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True, correction=0)
    return (rewards - mean) / std.clamp(min=std_floor)  # (G, M)


ESTIMATORS["floorgrpo"] = floorgrpo_advantages
'''

TERM_ESTIMATOR = '''\
def termrloo_advantages(rewards: torch.Tensor, *, terms: dict | None = None) -> torch.Tensor:
    """RLOO on each reward term alone, summed by the terms' --reward-weights weights (GDPO's first step, RLOO's
    baseline). A keyword-only `terms` is a step input, not a flag: compute_advantages passes the step's terms."""
    if terms is None:  # a direct call on the summed reward: one term
        return rloo_advantages(rewards)
    return sum(weight * rloo_advantages(term) for weight, term in terms.values())  # (G, M)


ESTIMATORS["termrloo"] = termrloo_advantages
'''

TASK = """\
def _qa(row: dict) -> Example:
    return Example(prompt=_chat(f"{row['problem']}\\n{BOXED}"), gold=str(row["answer"]), reference="")


TASKS["qa"] = Task(
    name="qa",
    columns={"problem": str, "answer": str},
    key=("problem",),
    make_example=_qa,
    verifier=lambda completion, ex: math_reward(completion, ex.gold),
    answer=_boxed_or_answer,
)
"""

AGGREGATION = '''\
def seq_mean_token_sum(mask, norm_len):
    """Each sequence's token sum, averaged over the minibatch's sequences: long answers weigh more."""
    return mask, sequences(mask)  # the rows with a token: --mask-truncated empties the cut ones


AGGREGATIONS["seq-mean-token-sum"] = seq_mean_token_sum
'''

REWARD_TERM = '''\
def brevity_reward(completion, example) -> float:
    """1 for an answer of at most 50 words, falling to 0 at 250: a length term to weigh against the others."""
    return (250 - len(final_answer(completion).split())) / 200


REWARD_TERMS["brevity"] = brevity_reward
'''

ROW_FILTER = '''\
def equal_rewards(rewards, truncated):
    """Mask the groups without signal, whose rewards are all equal: the batch shrinks, nothing is refilled."""
    return rewards.std(-1, keepdim=True) > 0  # (G, 1): the whole group stays or leaves


ROW_FILTERS["equal-rewards"] = equal_rewards
'''

ROLLOUT = '''\
def hardest_rollout(step: int, **run) -> Batch:
    """Keep the hardest groups: sample twice the prompts, keep each rank's half with the lowest mean reward."""
    args, size = run["args"], len(run["train_set"])  # round r samples the data stream's r-th batch of the step
    rounds = [sample_round(step, r, batch_indices(step, args.rollout_batch, size, args.seed, r), **run) for r in (0, 1)]
    world, n = run["world"], len(rounds[0].groups)
    mean = torch.stack([b.scores["rewards"].mean(-1) for b in rounds]).view(2, world, n)  # (rounds, ranks, G_local)
    picks = [
        sorted([(r, i) for r in (0, 1) for i in range(n)], key=lambda c: float(mean[c[0], q, c[1]]))[:n]
        for q in range(world)
    ]  # rank q's (round, group) pairs, hardest first
    return assemble(rounds, picks, run["rank"])


ROLLOUTS["hardest"] = hardest_rollout
'''

TOOL = '''\
def count_words(text: str) -> str:
    """The number of words between <words> and </words>, a count a small model gets wrong."""
    return str(len(text.split()))


TOOLS["words"] = count_words
'''

REWARD_MODEL_TERM = '''\
def rm_answer_reward(completion, example, reward_model) -> float:
    """--reward-model's score of the final answer alone, without the reasoning before it."""
    return reward_model([example.prompt], [final_answer(completion)])[0]


REWARD_TERMS["rm-answer"] = rm_answer_reward
'''

OWN_TASK = '''\
def mentions_keyword(completion, example) -> float:
    """1 when the answer names the row's keyword: this task's own reward, a --reward-weights term."""
    return float(example.meta["keyword"].lower() in final_answer(completion).lower())


def _topic(row: dict) -> Example:
    return Example(
        prompt=_chat(f"Write one sentence about {row['topic']}.", system=None),
        gold=None,
        reference=row["example"],
        meta={"keyword": row["keyword"]},
    )


REWARD_TERMS["mentions"] = mentions_keyword
TASKS["topic"] = Task(
    name="topic", columns=dict.fromkeys(("topic", "keyword", "example"), str), key=("topic",), make_example=_topic
)
'''

KL_ESTIMATOR = '''\
def kl_k3_clipped(logp, ref_logp):
    """k3 capped at 10 per token, as verl's low_var_kl: one token far from the reference cannot swamp the KL."""
    return kl_k3(logp, ref_logp).clamp(max=10.0)  # (B, T)


KL_ESTIMATORS["k3-clipped"] = kl_k3_clipped
'''

LOSS_TERM = '''\
def logratio_l2(logp, old_logp, mask):
    """A trust region by penalty: (log pi_theta - log pi_old)^2 per token, beside the clip (0 until pi_theta moves)."""
    return (logp - old_logp) ** 2  # (B, T)


LOSS_TERMS["l2"] = logratio_l2
'''

REFERENCE = '''\
def ema_warmup_reference(ref, policy, step, ref_ema, ref_reset_every):
    """EMA toward the policy at a rate ramped from 0 to --ref-ema over the first 100 optimizer steps."""
    ref.lerp_(policy, ref_ema * min(1.0, step / 100))


REFERENCES["ema-warmup"] = ema_warmup_reference
'''

RECIPES = [
    ("advantage.py", ESTIMATOR),
    ("advantage.py", TERM_ESTIMATOR),
    ("tasks.py", TASK),
    ("loss.py", AGGREGATION),
    ("rewards.py", REWARD_TERM),
    ("loss.py", ROW_FILTER),
    ("tasks.py", OWN_TASK),
    ("loss.py", KL_ESTIMATOR),
    ("loss.py", LOSS_TERM),
    ("rollout.py", ROLLOUT),
    ("rollout.py", TOOL),
    ("rewards.py", REWARD_MODEL_TERM),
    ("loss.py", REFERENCE),
]


def repository_files():
    """The repository's files as a fresh clone has them, plus this checkout's uncommitted ones (git's view)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode == 0:
        return [name for name in listed.stdout.split("\0") if name and os.path.isfile(os.path.join(ROOT, name))]
    return [
        os.path.relpath(os.path.join(folder, name), ROOT)
        for folder, dirs, names in os.walk(ROOT)
        if not any(
            part.startswith((".", "__")) or part == "runs"
            for part in os.path.relpath(folder, ROOT).split(os.sep)
            if part != "."
        )
        for name in names
    ]


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    """A copy of the repository with the recipes appended to their files, and its data files."""
    root = tmp_path_factory.mktemp("fork")
    for name in repository_files():
        os.makedirs(root / os.path.dirname(name), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), root / name)
    for name, code in RECIPES:
        with open(root / name, "a") as f:
            f.write(f"\n\n{code}")
    rows = [{"problem": f"What is {a} times {b}?", "answer": str(a * b)} for a in range(2, 10) for b in range(2, 10)]
    (root / "qa.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    topics = [{"topic": f"the number {n}", "keyword": str(n), "example": f"{n} is a number."} for n in range(60)]
    (root / "topics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in topics))
    return root


def run_in(fork, *argv, timeout=900):
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *argv], cwd=fork, capture_output=True, text=True, timeout=timeout, env=env)


# What each recipe must do, checked in the fork (the fresh processes a fork's user runs).
CHECKS = r"""
import pytest, torch
import advantage, loss, rewards, tasks
from advantage import compute_advantages, estimator_params
from grad_alloc import allocation_by_estimator
from loss import aggregate, loss_denominator, policy_loss
from tools.theory import population_weight

# 1. the estimator and its hyperparameter
assert estimator_params()["std_floor"] == (0.1, float)  # config.py builds --std-floor from this
r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])  # std 0.433; a constant group
adv = compute_advantages("floorgrpo", r, tau=0.3, std_floor=0.5)  # every estimator's flags passed along
assert torch.allclose(adv[0], torch.tensor([0.75, -0.25, -0.25, -0.25]) / 0.5) and torch.equal(adv[1], torch.zeros(4))
assert torch.allclose(compute_advantages("floorgrpo", r)[0], compute_advantages("grpo", r)[0], atol=1e-5)
assert torch.isfinite(population_weight("floorgrpo", 8, torch.tensor([0.1, 0.5]), std_floor=0.2)).all()
shares = allocation_by_estimator(r, torch.ones(2, 4), ["floorgrpo"], std_floor=0.2)["floorgrpo"]
assert sum(shares) == pytest.approx(100)

# 1b. the per-term estimator: its terms from the step, no flag of its own
a, b = torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.tensor([[0.0, 1.0, 1.0, 0.0]])
terms = {"exact": (1.0, a), "format": (0.5, b)}
rloo = advantage.rloo_advantages
assert torch.allclose(compute_advantages("termrloo", a + 0.5 * b, terms=terms), rloo(a) + 0.5 * rloo(b))
assert torch.equal(compute_advantages("termrloo", a), rloo(a)) and "terms" not in estimator_params()
terms_shares = allocation_by_estimator(a, torch.ones(1, 4), ["termrloo"])["termrloo"]
assert sum(terms_shares) == pytest.approx(100)

# 2. the task: held out by hash, scored by math-verify, no hub dataset
qa = tasks.get_task("qa")
train_rows, test_rows = qa.load("train", data_file="qa.jsonl"), qa.load("test", data_file="qa.jsonl")
assert len(train_rows) + len(test_rows) == 64 and test_rows
assert not {ex.uid for ex in train_rows} & {ex.uid for ex in test_rows}
ex = train_rows[0]
words = ex.prompt[-1]["content"].split("?")[0].split()
product = int(words[2]) * int(words[4])
assert qa.reward(f"<think>multiply</think> So \\boxed{{{product}}}.", ex) == 1.0
assert qa.reward(f"<think>multiply</think> So \\boxed{{{product + 1}}}.", ex) == 0.0
try:
    qa.load("train")
    raise AssertionError("qa loaded without a --data-file")
except tasks.DataError as err:
    assert "--data-file" in str(err)

# 3. the aggregation
values, mask = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
assert aggregate(values, mask, "seq-mean-token-sum") == pytest.approx((6 + 4) / 2)
assert loss_denominator(mask, "seq-mean-token-sum") == 2

# 4. the reward term: clipped to [0, 1] and an exception scores 0, with no decorator
arith = tasks.get_task("arith")
assert tasks.reward_weights(arith, "exact", "exact=1,brevity=0.1") == {"exact": 1.0, "brevity": 0.1}
example = arith.load("test", limit=1)[0]
assert arith.reward("<think>add</think> 12", example, kind="brevity") == 1.0  # (250 - 1) / 200, clipped
assert arith.reward("<think>add</think> " + "word " * 150, example, kind="brevity") == pytest.approx(0.5)
assert arith.reward("word " * 400, example, kind="brevity") == 0.0  # negative, clipped

# 5. the batch filter: a group of equal rewards leaves, the others stay whole
keep = loss.ROW_FILTERS["equal-rewards"](torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.zeros(2, 2, dtype=torch.bool))
assert keep.expand(2, 2).tolist() == [[True, True], [False, False]]

# 7. the task with its own reward term, safe without a decorator
topic = tasks.get_task("topic")
rows = topic.load("train", data_file="topics.jsonl")
row = rows[0]
assert topic.reward(f"It is {row.meta['keyword']}.", row, kind="mentions") == 1.0
assert topic.reward("nothing here", row, kind="mentions") == 0.0
rewards.STRICT = False  # as in training: an exception scores 0 and is counted
assert topic.reward("x", tasks.Example(prompt=[], gold=None, reference=""), kind="mentions") == 0.0
assert rewards.take_error_count() == 1

# 8. the KL estimator: k3 below 10, capped at 10 above; chosen by name, so --kl-estimator takes it
logp, ref = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.5, 20.0]])  # k3: e^0.5 - 1.5 = 0.149, e^20 - 21 ~ 5e8
k3 = torch.tensor(0.5).exp().item() - 1.5
assert torch.allclose(loss.KL_ESTIMATORS["k3-clipped"](logp, ref), torch.tensor([[k3, 10.0]]))
_, m = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logp=ref, kl_estimator="k3-clipped")
assert m["kl"] == pytest.approx((k3 + 10) / 2, rel=1e-5)

# 9. the loss term: COEF x its token mean in the loss, its token mean in the metrics
logp = torch.tensor([[0.1, -0.2, 0.3]], requires_grad=True)
value, m = policy_loss(logp, torch.zeros(1, 3), torch.zeros(1), torch.ones(1, 3), beta=0.0, loss_terms="l2=0.1")
assert m["l2"] == pytest.approx(0.14 / 3) and value.item() == pytest.approx(0.1 * 0.14 / 3)

# 10. the rollout policy: twice the prompts sampled, the hardest half kept (one rank), scores following the groups
import sys
sys.path.insert(0, "tests")
import rollout, train
from dist_rollout import FakeSampler, PatternTask, pattern_data
patterns = [[1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]] * 3  # means 1, .75, .25, 0, .5
train_set, train_ids = pattern_data(patterns)
sampler = FakeSampler()
batch = rollout.ROLLOUTS["hardest"](5, sampler=sampler, task=PatternTask(), train_set=train_set, train_ids=train_ids,
                                    weights={"exact": 1.0}, args=train.Args(M=4, rollout_batch=4, seed=1), rank=0,
                                    world=1, device=torch.device("cpu"))
drawn = [i for r in (0, 1) for i in rollout.batch_indices(5, 4, 15, 1, r)]
means = sorted(sum(patterns[i]) / 4 for i in drawn)
assert len(sampler.calls) == 2 and sorted(batch.scores["rewards"].mean(-1).tolist()) == means[:4]
assert [sum(ex.meta["pattern"]) / 4 for ex in batch.examples] == batch.scores["rewards"].mean(-1).tolist()

# 11. the reference policy: a --reference choice, moving at the ramped rate
import config
assert "ema-warmup" in config.choices()["reference"]
ref = torch.zeros(2)
loss.REFERENCES["ema-warmup"](ref, torch.ones(2), 50, ref_ema=0.1, ref_reset_every=0)
assert torch.allclose(ref, torch.full((2,), 0.05))
# 12. the tool: its call answered, its closing tag among the samplers' stop strings
assert rollout.call_tool("How many? <words>one two three</words>") == "3"
assert "</words>" in [rollout.TOOL_TAGS[1].format(name) for name in rollout.TOOLS]

# 13. the reward term on the reward model: the final answer's score, and --reward-model is read by it
from test_reward_model import build_classifier
classifier = build_classifier("rm-fork")
rm = rewards.load_reward_model(classifier)
row = arith.load("test", limit=1)[0]
score = arith.reward("<think>long reasoning</think> 12", row, kind="rm-answer", reward_model=rm)
assert score == pytest.approx(rm([row.prompt], ["12"])[0]) and 0 < score < 1
assert rewards.reward_model_flag_error(classifier, {"exact": 1.0, "rm-answer": 0.5}) is None
assert "rm-answer reward term" in rewards.reward_model_flag_error("", {"rm-answer": 0.5})
print("recipes ok")
"""


def test_docs_show_exactly_this_code():
    page = open(os.path.join(ROOT, "docs", "fork.md")).read()
    for _, block in RECIPES:
        assert f"```python\n{block}```" in page
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Fork it", 1)[1].split("\n## ", 1)[0]
    assert "docs/fork.md" in section and section.count("\n| ") == 2 + len(RECIPES)  # one row per recipe


def test_each_recipe_does_what_it_says_in_the_fork(fork):
    result = run_in(fork, "-c", CHECKS)
    assert result.returncode == 0 and "recipes ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.slow
def test_the_fast_suite_stays_green_in_the_fork(fork):
    """The whole fast suite, in the fork: every registry a recipe reaches holds one more entry (TASKS, REWARD_TERMS
    and ROLLOUTS' file two), and stage files hold more code, so a test that pinned a registry to a list, or a file
    to its size, fails here."""
    suite = ["-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider", "tests"]
    result = run_in(fork, *suite, "--ignore", "tests/test_fork_it.py", timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:]


@pytest.mark.slow
def test_train_and_eval_run_with_every_recipe(fork, tiny_model_dir):
    """train.py two steps with the page's flags for the recipes (and the built-in --ratio sequence), then two steps
    of the new task on its own reward term, then eval.py scoring that run's checkpoint with the term."""
    common = [
        "--model",
        tiny_model_dir,
        "--M",
        "4",
        "--rollout-batch",
        "4",
        "--micro-batch",
        "8",
        "--steps",
        "2",
        "--max-tokens",
        "4",
        "--warmup-steps",
        "0",
        "--eval-examples",
        "0",
        "--dtype",
        "float32",
    ]
    result = run_in(
        fork,
        "train.py",
        "--task",
        "qa",
        "--data-file",
        "qa.jsonl",
        "--advantage",
        "floorgrpo",
        "--std-floor",
        "0.2",
        "--loss-agg",
        "seq-mean-token-sum",
        "--reward-weights",
        "exact=1,brevity=0.1",
        "--row-filter",
        "equal-rewards",
        "--ratio",
        "sequence",
        "--kl-estimator",
        "k3-clipped",
        "--loss-terms",
        "l2=0.1",
        "--alloc-estimators",
        "all",
        "--rollout",
        "hardest",
        "--reference",
        "ema-warmup",
        "--ref-ema",
        "0.1",
        "--out-dir",
        "run-qa",
        *common,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in open(fork / "run-qa" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["loss/pg"] == m["loss/pg"] for m in metrics)  # not NaN, even where the filter left no row
    assert all("alloc/floorgrpo/0.9-1" in m and 0.0 <= m["reward/brevity"] <= 1.0 for m in metrics)
    assert all(m["loss/l2"] == 0.0 for m in metrics)  # the new term's metric, with no other edit; 0 on-policy
    saved = json.loads(
        run_in(
            fork,
            "-c",
            "import json; from plumbing.checkpoint import find_checkpoint, "
            "read_trainer_state; print(json.dumps(read_trainer_state(find_checkpoint('run-qa'))"
            "['args']))",
        ).stdout
    )
    assert (
        saved["advantage"],
        saved["std_floor"],
        saved["loss_agg"],
        saved["row_filter"],
        saved["ratio"],
        saved["kl_estimator"],
        saved["loss_terms"],
        saved["rollout"],
        saved["reference"],
    ) == (
        "floorgrpo",
        0.2,
        "seq-mean-token-sum",
        "equal-rewards",
        "sequence",
        "k3-clipped",
        "l2=0.1",
        "hardest",
        "ema-warmup",
    )

    result = run_in(
        fork,
        "train.py",
        "--task",
        "topic",
        "--data-file",
        "topics.jsonl",
        "--reward-weights",
        "mentions=1,sim=0.5,rm-answer=0.2",
        "--reward-model",
        build_classifier(fork / "rm"),
        "--rollout",
        "tools",
        "--out-dir",
        "run-topic",
        *common,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in open(fork / "run-topic" / "metrics.jsonl")]
    assert all(0.0 <= m["reward/mentions"] <= 1.0 and "reward/sim" in m for m in metrics)
    assert all(0.0 < m["reward/rm-answer"] < 1.0 and m["rollout/tool_calls"] >= 0 for m in metrics)
    result = run_in(
        fork,
        "eval.py",
        "--task",
        "topic",
        "--data-file",
        "topics.jsonl",
        "--reward-weights",
        "mentions=1",
        "--model",
        str(fork / "run-topic" / "checkpoint-000002"),
        "--max-tokens",
        "4",
        "--out",
        "eval-topic.json",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mentions" in json.dumps(json.load(open(fork / "eval-topic.json"))["summary"])
