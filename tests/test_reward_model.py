"""A reward model as a reward term (issue 62): --reward-model PATH adds rm, a sigmoid of an
AutoModelForSequenceClassification's one logit, batched, loaded once a process, and the same in train.py and eval.py
because both score through rewards.term_rewards with rewards.reward_options. On a tiny random classifier built here.

    python -m pytest tests/test_reward_model.py
"""

import math
from dataclasses import replace

import pytest
import torch

import config
import eval as eval_py
import rewards
import rollout
import train
from tests.test_tools import digits  # noqa: F401 - a fixture
from tests.test_train import read_metrics, tiny_args
from tools.tiny_model import build_tokenizer


def build_classifier(path, num_labels=1, seed=0) -> str:
    """A one-layer random Llama classifier on the tiny tokenizer, its score head scaled so rewards spread."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = build_tokenizer()
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    llama = LlamaConfig(vocab_size=len(tokenizer), num_labels=num_labels, pad_token_id=tokenizer.pad_token_id, **sizes)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(llama)
    with torch.no_grad():
        model.score.weight.mul_(10.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return build_classifier(tmp_path_factory.mktemp("rm"))


PROMPTS = [[{"role": "user", "content": "say something"}], [{"role": "user", "content": "a much longer question"}]]
TEXTS = ["7", "a long answer that pads the other rows", "", "hello"]


def test_rm_is_a_sigmoid_in_0_1_and_a_batch_scores_each_row_as_alone(classifier):
    rm = rewards.load_reward_model(classifier)
    assert rewards.load_reward_model(classifier) is rm  # loaded once a process
    prompts = [PROMPTS[i % 2] for i in range(len(TEXTS))]
    batched = rm(prompts, TEXTS)
    alone = [rm([p], [t])[0] for p, t in zip(prompts, TEXTS)]
    assert batched == pytest.approx(alone, abs=1e-6)
    assert all(0 < r < 1 for r in batched) and max(batched) - min(batched) > 1e-3  # it reads the text
    # its logit, squashed: the classifier's own forward on one row
    chat = [*prompts[1], {"role": "assistant", "content": TEXTS[1]}]
    ids = rm.tokenizer(rm.tokenizer.apply_chat_template(chat, tokenize=False), return_tensors="pt")
    logit = rm.model(**ids).logits[0, 0]
    assert batched[1] == pytest.approx(torch.sigmoid(logit).item(), abs=1e-6)


class FixedSampler:
    """generate() gives each prompt the completions `texts`, n of them (greedy: the first)."""

    def __init__(self, texts):
        self.tokenizer = build_tokenizer()
        self.texts = texts

    def generate(self, prompts, *, n, max_tokens, seed=0, **filters):
        def one(text):
            return rollout.completion(self.tokenizer, self.tokenizer.encode(text), [0.0] * len(text), "stop")

        return [[one(self.texts[k % len(self.texts)]) for k in range(n)] for _ in prompts]


def test_train_and_eval_give_the_same_rm_reward_for_the_same_completion(classifier):
    """The train rollout's score() and eval.evaluate() on the same completions, the overlong term beside rm (its
    buffer was eval's own before: --reward-weights overlong=1 scored otherwise there)."""
    from tasks import get_task

    task = get_task("arith")
    examples = task.load("train", limit=2)
    sampler = FixedSampler(TEXTS)
    weights = {"rm": 0.5, "overlong": 1.0}
    options = rewards.reward_options(12, overlong_buffer=3, reward_model=classifier)
    groups = sampler.generate([[1], [2]], n=4, max_tokens=12)
    scores = rollout.score(task, examples, groups, weights, torch.device("cpu"), options)
    result = eval_py.evaluate(sampler, task, examples, samples=4, max_tokens=12, weights=weights, options=options)
    for i, record in enumerate(result["examples"]):
        assert record["terms"]["rm"] == pytest.approx(scores["terms"]["rm"][i, 0].item(), abs=1e-6)  # greedy
        assert record["sampled_rewards"] == pytest.approx(scores["rewards"][i].tolist(), abs=1e-6)
    assert scores["terms"]["overlong"].min() < 1  # the buffer bites: the 38-token answer
    assert not torch.equal(scores["terms"]["rm"][0], scores["terms"]["rm"][0].flip(0))


@pytest.mark.parametrize(
    "flags,said",
    [
        (dict(reward_weights="exact=1,rm=0.5"), "the rm reward term scores with --reward-model PATH"),
        (dict(reward_model="RM"), "--reward-model is read only by a term that scores with it"),
        (dict(reward_weights="exact=1,rm=0.5", reward_model="nowhere"), "--reward-model nowhere is not a model"),
        (dict(reward_weights="exact=1,rm=0.5", reward_model="CAUSAL"), "not an AutoModelForSequenceClassification"),
        (dict(reward_weights="exact=1,rm=0.5", reward_model="TWO"), "has 2 labels: rm reads one score"),
    ],
)
def test_a_reward_model_flag_that_cannot_work_is_one_line(flags, said, classifier, tiny_model_dir, tmp_path):
    paths = {"RM": classifier, "CAUSAL": tiny_model_dir, "TWO": build_classifier(tmp_path / "two", num_labels=2)}
    flags = {k: paths.get(v, v) for k, v in flags.items()}
    args = replace(train.Args(task="arith", model=tiny_model_dir, out_dir=str(tmp_path / "run")), **flags)
    error = config.check_args(args)
    assert error is not None and said in error and "\n" not in error


def test_eval_refuses_rm_without_a_reward_model_in_one_line(tiny_model_dir, tmp_path, capsys):
    argv = [
        "--model",
        tiny_model_dir,
        "--task",
        "arith",
        "--reward-weights",
        "exact=1,rm=1",
        "--out",
        str(tmp_path / "e"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        eval_py.main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err == (
        "eval.py: error: the rm reward term scores with --reward-model PATH, which is not given"
    )


@pytest.mark.usefixtures("digits")
def test_a_run_trains_on_the_rm_term(classifier, tiny_model_dir, tmp_path):
    args = tiny_args(tiny_model_dir, tmp_path / "run", reward_weights="exact=1,rm=0.5", reward_model=classifier)
    train.main(replace(args, eval_examples=4, max_tokens=8))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and all(0 < r["reward/rm"] < 1 and math.isfinite(r["loss/pg"]) for r in rows)
