"""Tool calls and the per-token loss mask (issue 62): rollout.ToolSampler, call_tool and rewards.calc on a scripted
sampler; stop strings in the HF sampler; Completion.policy through loss.policy_loss and train.ppo_update in float64;
and train.py --rollout tools end to end, resumed to the bit (the vLLM sampler's run: tests/test_train_vllm.py).

    python -m pytest tests/test_tools.py
"""

import json
import time

import pytest
import torch

import rollout
import tasks
import train
from loss import AGGREGATIONS, policy_loss
from rewards import calc
from rollout import ToolSampler
from tests.test_train import DigitTask, read_metrics, tiny_args
from tools.tiny_model import build_tokenizer

TOKENIZER = build_tokenizer()  # a token a character: a script's text is its ids


class ScriptedSampler:
    """A sampler that writes, after a context holding k tool outputs, the text script[k] (its last entry past the
    end), then EOS; it stops at a `stop` string as a sampler does. Records each call's seeds, budgets and stops."""

    def __init__(self, script, carry=0):
        self.script = script
        self.carry = carry  # characters the stopping token holds past the stop string
        self.tokenizer = TOKENIZER
        self.calls = []

    def generate(self, prompts, *, n, max_tokens, seed=0, stop=(), **filters):
        seeds = rollout.per_prompt(seed, len(prompts), step=n)
        budgets = rollout.per_prompt(max_tokens, len(prompts), step=0)
        self.calls.append({"seeds": seeds, "budgets": budgets, "stop": list(stop), "n": n})
        groups = []
        for ids, budget in zip(prompts, budgets):
            outputs = TOKENIZER.decode(ids).count("<result>")
            text = self.script[min(outputs, len(self.script) - 1)]
            ends = [text.find(s) + len(s) for s in stop if s in text]
            reason = "stop"
            if ends:
                text = text[: min(ends) + self.carry]
                reason = "stop_string"
            tokens = TOKENIZER.encode(text)
            if reason == "stop":
                tokens.append(TOKENIZER.eos_token_id)
            if len(tokens) > budget:
                tokens = tokens[:budget]
                reason = "length"
            groups.append([rollout.completion(TOKENIZER, tokens, [-0.5] * len(tokens), reason) for _ in range(n)])
        return groups


def tool_run(script, max_calls=2, max_tokens=64, prompts=("What is 2 + 3?",), n=1, carry=0):
    sampler = ScriptedSampler(script, carry)
    tools = ToolSampler(sampler, max_calls, turn_streams=1000)
    groups = tools.generate([TOKENIZER.encode(p) for p in prompts], n=n, max_tokens=max_tokens, seed=7)
    return groups, sampler, tools


def test_a_tool_call_is_answered_by_the_tools_own_ids_which_the_policy_did_not_sample():
    (group,), sampler, tools = tool_run(["Let me add: <calc>2 + 3</calc>!", " so it is 5"])
    (c,) = group
    assert c.text == "Let me add: <calc>2 + 3</calc><result>5</result> so it is 5"
    assert c.finish_reason == "stop" and tools.calls == 1
    call_end = len("Let me add: <calc>2 + 3</calc>")
    output = TOKENIZER.encode("<result>5</result>", add_special_tokens=False)  # tokenised on its own
    assert c.token_ids[call_end : call_end + len(output)] == output
    assert c.policy == [True] * call_end + [False] * len(output) + [True] * (len(c.token_ids) - call_end - len(output))
    assert [lp for lp, sampled in zip(c.logprobs, c.policy) if not sampled] == [0.0] * len(output)
    assert len(c.token_ids) == len(c.logprobs) == len(c.policy)
    # turn 1 samples row 0 on stream seed + 1 * turn_streams + 0, with what is left of the budget
    first, second = sampler.calls
    assert "</calc>" in first["stop"] and first["seeds"] == [7]
    assert second["seeds"] == [7 + 1000] and second["budgets"] == [64 - call_end - len(output)]


def test_a_token_that_closes_the_call_may_carry_more_characters():
    """A sampler stops at the token that completes </calc>; what else that token holds stays, the policy's."""
    (group,), _, tools = tool_run(["<calc>4*4</calc>. done", ". done"], max_calls=1, carry=1)
    assert tools.calls == 1 and group[0].text == "<calc>4*4</calc>.<result>16</result>. done"


def test_max_tool_calls_bounds_the_calls_and_the_last_turn_samples_past_tags():
    (group,), sampler, tools = tool_run(["<calc>1+1</calc>"], max_calls=2, max_tokens=200)
    assert tools.calls == 2 and group[0].text.count("<result>2</result>") == 2
    stops = [rollout.TOOL_TAGS[1].format(name) for name in rollout.TOOLS]  # calc's and any a fork adds
    assert [call["stop"] for call in sampler.calls] == [stops, stops, []]  # the last: no stop
    (group,), sampler, tools = tool_run(["<calc>1+1</calc>"], max_calls=0)
    assert tools.calls == 0 and sampler.calls[0]["stop"] == [] and group[0].policy == [True] * len(group[0].token_ids)


def test_an_output_past_the_budget_is_cut_and_the_completion_ends_there():
    (group,), sampler, _ = tool_run(["<calc>123456789*987654321</calc>"], max_tokens=30)
    (c,) = group
    assert len(c.token_ids) == 30 and c.finish_reason == "length" and len(sampler.calls) == 1  # no room to go on
    assert c.text == "<calc>123456789*987654321</calc><result>12"[:30]


def loop_forever(text):
    while True:
        pass


@pytest.mark.parametrize(
    "tool,said",
    [
        (lambda text: int("x"), "error: invalid literal for int() with base 10: 'x'"),
        (lambda text: "first line\n" * 3 + "x" * 300, "error: probe's output has 333 characters, over 200"),
        (lambda text: "y" * 10_000_000, "error: probe's output has 10,000,000 characters, over 200"),
        (loop_forever, "error: probe took over 0.3 s"),
    ],
    ids=["fails", "long", "10 MB", "loops"],
)
def test_a_tool_that_fails_loops_or_floods_is_bounded_and_said_in_one_line(monkeypatch, tool, said):
    monkeypatch.setitem(rollout.TOOLS, "probe", tool)
    monkeypatch.setattr(rollout, "TOOL_TIMEOUT_S", 0.3)
    start = time.monotonic()
    (group,), _, _ = tool_run(["<probe>q</probe>", " ok"], max_calls=1, max_tokens=400)
    assert time.monotonic() - start < 5
    assert group[0].text == f"<probe>q</probe><result>{said}</result> ok" and "\n" not in said


def test_a_close_tag_without_its_opening_is_answered_as_an_error():
    assert rollout.call_tool("no call here</calc>") == "error: </calc> closes no <calc>"


@pytest.mark.parametrize(
    "expr,value",
    [("2 + 3", "5"), ("(1+2)*3", "9"), ("7/2", "3.5"), ("1/3", "0.3333333333"), ("-4 - 6", "-10"), ("10/5", "2")],
)
def test_calc_evaluates_arithmetic_exactly(expr, value):
    assert calc(expr) == value


@pytest.mark.parametrize(
    "expr,said",
    [
        ("__import__('os').system('echo hi')", "integers and"),
        ("2**100", "integers and"),
        ("1/0", "division by zero"),
        ("1" * 201, "at most 200"),
        ("(" * 17 + "1" + ")" * 17, "16 nested"),
    ],
)
def test_calc_refuses_what_is_not_plain_arithmetic(expr, said):
    with pytest.raises(ValueError, match=said):
        calc(expr)


# ---------------------------------------------------------------- stop strings in the HF sampler
@pytest.mark.parametrize("fast", [False, True], ids=["plain loop", "fast path"])
def test_the_hf_sampler_stops_at_a_stop_string_on_the_same_stream(tiny_model_dir, fast):
    sampler = rollout.HFSampler(tiny_model_dir, dtype="float32", fast=fast)
    prompts = [sampler.tokenizer.encode(t) for t in ("abc", "a longer prompt")]
    free = sampler.generate(prompts, n=3, max_tokens=24, seed=5)
    text = free[1][2].text
    stop = text[5:7]
    stopped = sampler.generate(prompts, n=3, max_tokens=24, seed=5, stop=[stop])
    for g_free, g_stopped in zip(free, stopped):
        for a, b in zip(g_free, g_stopped):
            assert a.token_ids[: len(b.token_ids)] == b.token_ids and a.logprobs[: len(b.logprobs)] == b.logprobs
            if stop in a.text:  # it ends at the first token whose text completes the stop string
                assert b.finish_reason == "stop_string" and b.text.endswith(stop) and b.text.count(stop) == 1
            else:
                assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
    assert stopped[1][2].text == text[:7]
    # a seed and a budget a prompt: each prompt as if alone
    both = sampler.generate(prompts, n=2, max_tokens=[24, 9], seed=[5, 11])
    alone = [sampler.generate([p], n=2, max_tokens=k, seed=s)[0] for p, k, s in zip(prompts, (24, 9), (5, 11))]
    assert [[c.token_ids for c in g] for g in both] == [[c.token_ids for c in g] for g in alone]
    assert all(len(c.token_ids) <= 9 for c in both[1])


# ---------------------------------------------------------------- the per-token loss mask
@pytest.mark.parametrize("loss_agg", list(AGGREGATIONS))
def test_tool_tokens_get_no_gradient_and_policy_tokens_the_gradient_of_the_run_without_them(loss_agg):
    """policy_loss in float64 on (B, T) tensors where some tokens are a tool's: the gradient at those is exactly 0,
    and at every policy token it equals that of the same loss on the policy tokens alone (the tool's removed)."""
    torch.manual_seed(0)
    B, T = 3, 7
    sampled = torch.rand(B, T) > 0.35
    lengths = [7, 5, 6]
    layout = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).double()
    mask = layout * sampled
    logp = (-torch.rand(B, T, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.05 * torch.randn(B, T, dtype=torch.float64)
    ref = logp.detach() + 0.05 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    options = dict(beta=0.1, loss_agg=loss_agg, norm_len=T)
    loss, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, **options)
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all() and (logp.grad[mask > 0] != 0).all()
    # the run without the tool's tokens: each row's policy tokens alone, left-aligned
    kept = [mask[i].nonzero().squeeze(-1) for i in range(B)]
    width = max(len(k) for k in kept)

    def compact(values):
        out = torch.zeros(B, width, dtype=torch.float64)
        for i, k in enumerate(kept):
            out[i, : len(k)] = values[i, k]
        return out

    alone = compact(logp.detach()).requires_grad_()
    alone_mask = compact(mask)
    loss_alone, _ = policy_loss(alone, compact(old), adv, alone_mask, ref_logp=compact(ref), **options)
    loss_alone.backward()
    assert torch.allclose(loss, loss_alone, rtol=1e-12, atol=0)
    assert torch.allclose(compact(logp.grad), alone.grad * alone_mask, rtol=1e-12, atol=1e-15)


def tool_batch():
    """Six sequences of the tiny tokenizer, each completion with a span of 'tool' tokens in its middle (but one)."""
    torch.manual_seed(3)
    prompts = [TOKENIZER.encode(t) for t in ("ab", "what is it", "x", "hello there", "q", "ok")]
    lengths = [9, 6, 11, 4, 8, 10]
    completions = [torch.randint(4, 90, (k,)).tolist() for k in lengths]
    policy = []
    for i, k in enumerate(lengths):
        row = [True] * k
        if i != 3:
            row[2 : 2 + i % 3 + 1] = [False] * (i % 3 + 1)
        policy.append(row)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, -0.25])
    return prompts, completions, policy, adv


def policy_update(model_dir, policy, pack=False, micro_batch=4, keep=None):
    """One SGD step of train.ppo_update in float64 (beta 0, one epoch): the weights after, as float64 tensors."""
    from transformers import AutoModelForCausalLM

    prompts, completions, _, adv = tool_batch()
    sizes = dict(M=2, rollout_batch=3, micro_batch=micro_batch, pack=pack)
    args = train.Args(**sizes, beta=0.0, lr=1.0, warmup_steps=0, dtype="float32", max_grad_norm=1e9)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    sampler_logps = [[0.0] * len(c) for c in completions]
    train.ppo_update(model, None, optimizer, scheduler, prompts, completions, sampler_logps, adv, args, 0, keep, policy)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_ppo_update_steps_by_the_policy_tokens_gradient_alone(tiny_model_dir):
    """In float64 on the tiny model: the step equals -lr x the gradient of the token mean of -A x log pi over the
    policy tokens only, with the tool's tokens still in every sequence's context."""
    from transformers import AutoModelForCausalLM

    from speed.logprobs import pad_batch, sequence_logprobs

    prompts, completions, policy, adv = tool_batch()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    input_ids, attention_mask, layout = pad_batch(prompts, completions, 0)
    sampled = torch.nn.utils.rnn.pad_sequence([torch.tensor(p, dtype=torch.float64) for p in policy], batch_first=True)
    mask = layout.double() * sampled
    logp = sequence_logprobs(model, input_ids, attention_mask, layout.shape[1])
    (-(adv.double()[:, None] * logp * mask).sum() / mask.sum()).backward()  # on policy: d ratio = d log pi
    want = {name: before[name] - p.grad for name, p in model.named_parameters()}
    after = policy_update(tiny_model_dir, policy)
    for name, value in want.items():
        assert torch.allclose(after[name], value, rtol=0, atol=1e-12), name
    assert any(not torch.equal(after[n], before[n]) for n in want)


def test_the_mask_leaves_the_default_update_bit_for_bit_and_packs_as_it_pads(tiny_model_dir):
    prompts, completions, policy, _ = tool_batch()
    everything = [[True] * len(c) for c in completions]
    plain = policy_update(tiny_model_dir, None)
    assert all(torch.equal(plain[k], v) for k, v in policy_update(tiny_model_dir, everything).items())
    padded = policy_update(tiny_model_dir, policy, micro_batch=2)
    packed = policy_update(tiny_model_dir, policy, pack=True, micro_batch=2)
    assert all(torch.allclose(packed[k], v, rtol=0, atol=1e-10) for k, v in padded.items())
    assert any(not torch.allclose(padded[k], v, rtol=0, atol=1e-10) for k, v in plain.items())
    # a dropped sequence beside packed ones: its tokens are in the packed row, and the rest still land in place
    keep = torch.tensor([True, False, True, True, False, True])
    padded = policy_update(tiny_model_dir, policy, micro_batch=3, keep=keep)
    packed = policy_update(tiny_model_dir, policy, pack=True, micro_batch=3, keep=keep)
    assert all(torch.allclose(packed[k], v, rtol=0, atol=1e-10) for k, v in padded.items())


# ---------------------------------------------------------------- train.py --rollout tools, end to end
@pytest.fixture
def digits(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "digits", DigitTask())


def common_character_calls(monkeypatch):
    """The tiny random model writes no <calc>: a call here is closed by "q", about one character in a hundred, and
    opened by the "q" before it, if any (else the output is an error line), so calls come at random positions."""
    monkeypatch.setattr(rollout, "TOOL_TAGS", ("{}", "{}"))
    monkeypatch.setattr(rollout, "TOOLS", {"q": lambda text: "7"})


def test_a_tools_run_calls_its_tool_and_resumes_to_the_bit(tiny_model_dir, tmp_path, digits, monkeypatch):
    common_character_calls(monkeypatch)
    flags = dict(rollout="tools", max_tokens=64, max_tool_calls=2, steps=3, log_completions=16, eval_examples=4)
    train.main(tiny_args(tiny_model_dir, tmp_path / "straight", **flags))
    split = tmp_path / "split"
    train.main(tiny_args(tiny_model_dir, split, **{**flags, "steps": 2}))
    train.main(tiny_args(tiny_model_dir, split, **flags, resume=str(split)))

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "mem/"))} for r in rows]

    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert comparable(straight) == comparable(read_metrics(split / "metrics.jsonl"))
    samples = read_metrics(tmp_path / "straight" / "completions.jsonl")
    assert samples == read_metrics(split / "completions.jsonl")
    assert sum(r["rollout/tool_calls"] for r in straight) > 0
    assert any("<result>" in s["completion"] for s in samples)
    assert all(len(json.dumps(r)) and r["loss/pg"] == r["loss/pg"] for r in straight)  # finite, not NaN
