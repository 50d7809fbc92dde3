"""Rewards: known answers, hand-computed similarity, and an adversarial corpus that must score 0."""

import multiprocessing
import os
import random
import signal
import threading

import pytest
from rouge_score import rouge_scorer

import rewards
from rewards import (
    countdown_reward,
    final_answer,
    format_reward,
    integer_reward,
    lcs_length,
    math_reward,
    similarity_reward,
    squad_words,
)


def test_final_answer():
    assert final_answer("<think>so 5</think> 7") == "7"
    assert final_answer("<think>a</think> x <think>b</think>  y ") == "y"  # after the last </think>
    assert final_answer("<think>a</think> so <answer> 12 </answer> done") == "12"
    assert final_answer("<answer>1</answer><answer>2</answer>") == "2"
    assert final_answer("<answer>cut off") == "cut off"  # truncated answer tag
    assert final_answer("plain") == "plain"
    assert final_answer("") == "" and final_answer(None) == ""


# ---------------------------------------------------------------- math
@pytest.mark.parametrize(
    "completion, gold",
    [
        ("<think>half</think> 0.5", r"\frac12"),
        ("1000", "1,000"),
        (r"<think>x</think> The answer is \boxed{72}.", "72"),
        (r"<answer>$\frac{\sqrt3}{2}$</answer>", r"\dfrac{\sqrt{3}}{2}"),
        (r"\boxed{1+x^2}", "x^2+1"),
        (r"\boxed{3}", r"\boxed{3}"),  # an already boxed gold is not boxed twice
    ],
)
def test_math_reward_positive(completion, gold):
    assert math_reward(completion, gold) == 1.0


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("<think>x</think> 73", "72"),
        (r"<think>\boxed{72}</think> I am not sure", "72"),  # the answer inside the thinking does not count
        ("", "72"),
        ("72", ""),
        ("1,2", "12"),
    ],
)
def test_math_reward_negative(completion, gold):
    assert math_reward(completion, gold) == 0.0


def test_math_reward_works_from_a_thread():
    # math-verify's own SIGALRM timeout raises outside the main thread
    results = []
    threads = [threading.Thread(target=lambda: results.append(math_reward("0.5", r"\frac12"))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [1.0, 1.0, 1.0]


def test_math_reward_works_in_forked_daemonic_workers():
    math_reward("1", "1")  # the parent's worker exists before the fork
    with multiprocessing.get_context("fork").Pool(2) as pool:  # pool workers are daemonic
        assert pool.starmap(math_reward, [("0.5", r"\frac12"), ("7", "8")]) == [1.0, 0.0]
    assert math_reward("2", "2") == 1.0  # and the parent's worker still answers


def test_math_reward_recovers_after_a_hanging_expression(monkeypatch):
    monkeypatch.setitem(rewards._errors, "printed", True)  # the timeout's line stays out of the output, and the
    monkeypatch.setitem(rewards._errors, "count", 0)  # count out of later tests
    assert math_reward("9**9**9**9", "2") == 0.0  # sympy would run for minutes: the worker is killed
    assert math_reward(r"\boxed{2}", "2") == 1.0  # a fresh worker takes over


# ---------------------------------------------------------------- countdown
@pytest.mark.parametrize(
    "completion, numbers, target",
    [
        ("8/(3-8/3)", [3, 3, 8, 8], 24),  # exact rationals: a float check could miss this
        ("<think>try</think> 8 / (3 - 8 / 3) = 24", [8, 8, 3, 3], 24),
        (r"<think>t</think> so \boxed{8 ÷ (3 − 8 ÷ 3)}", [3, 3, 8, 8], 24),  # unicode operators
        (r"$(1 + 2 + 3) \times 4$", [1, 2, 3, 4], 24),
        ("<answer> 1 * 2 * 3 * 4 </answer>", [4, 3, 2, 1], 24),
        ("Working...\n(44 + 19) + 35", [44, 19, 35], 98),  # last line of the answer
        ("95 - 11 - 56.", [95, 11, 56], 28),
        ("-(3 - 8) * 4 + 4", [3, 8, 4, 4], 24),  # unary minus
        ("+5-3", [5, 3], 2),  # unary plus: 5 - 3, as Python and TinyZero's eval-based checker read it
        ("(+8) * 3", [8, 3], 24),
    ],
)
def test_countdown_reward_positive(completion, numbers, target):
    assert countdown_reward(completion, numbers, target) == 1.0


@pytest.mark.parametrize(
    "completion, numbers, target",
    [
        ("8/(3-8/3) = 25", [3, 3, 8, 8], 24),  # wrong right-hand side
        ("8*3", [3, 3, 8, 8], 24),  # numbers missing
        ("8*3 + 3 - 3 + 8 - 8", [3, 3, 8, 8], 24),  # numbers used twice
        ("4*6", [1, 2, 3, 4], 24),  # correct value, wrong number set
        ("(1+2+3)*4", [1, 2, 3, 5], 24),  # correct value, a supplied number replaced
        ("1 + 2 + 3 + 4", [1, 2, 3, 4], 24),  # wrong value
        ("8 / (3 - 3) + 8 + 8", [3, 3, 8, 8, 8], 24),  # division by zero
        ("2**3 * 3", [2, 3, 3], 24),  # exponentiation
        ("(8 // 3) * 8 + 8", [8, 3, 8, 8], 24),  # floor division
        ("24.0", [24], 24),  # floats
        ("x * 24", [24], 24),  # names
        ("", [1], 1),
    ],
)
def test_countdown_reward_negative(completion, numbers, target):
    assert countdown_reward(completion, numbers, target) == 0.0


@pytest.mark.parametrize(
    "completion",
    ["(3+3)*4*", "3 3 4 1", "(3+3)*4*1)", "((3+3)*4*1", "3 + 3 + 4 1", "03 * 8", "<think>t</think> \\boxed{(3+3)*}"],
)
def test_unparseable_countdown_text_is_a_wrong_answer_not_a_reward_error(completion):
    """ast.parse raised on these: they were counted in reward/errors, printed a traceback, raised under strict
    mode (the tests run strict: tests/conftest.py). Text that is no expression is a wrong answer."""
    rewards.take_error_count()
    assert rewards.STRICT  # would raise here if the reward still raised
    assert countdown_reward(completion, [3, 3, 4, 1], 24) == 0.0
    assert rewards.take_error_count() == 0


# ---------------------------------------------------------------- arith, format
def test_integer_reward():
    assert integer_reward("7 + 5 = 12.", "12") == 1.0
    assert integer_reward("<think>7+5</think> It is 12, I think", "12") == 1.0
    assert integer_reward(r"\boxed{12} and then 13", "12") == 1.0  # the boxed answer wins
    assert integer_reward("The sum is 1,200", "1200") == 1.0
    assert integer_reward("12 or maybe 13", "12") == 0.0
    assert integer_reward("twelve", "12") == 0.0
    assert integer_reward("-3", "3") == 0.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        (r"\boxed{[8, 0]}", ""),  # a boxed list holds no one answer: was "0", its last number
        (r"\boxed{8, 0}", ""),
        (r"\boxed{(8, 0)}", ""),
        (r"\boxed{\{1, 2, 3\}}", ""),
        (r"\boxed{8; 0}", ""),
        (r"\boxed{8;0}", ""),
        (r"\boxed{8 ,0}", ""),
        (r"\boxed{8,\ 0}", ""),
        (r"\boxed{8,\,0}", ""),
        (r"\boxed{8,~0}", ""),
        (r"\boxed{[8,0]}", "8,0"),  # no whole number either: never 80 or 0
        ("\\boxed{\uff18\uff10}", "80"),  # fullwidth digits (NFKC): was ""
        ("\\boxed{\uff0d\uff15}", "-5"),
        ("\\boxed{\u22125}", "-5"),
        (r"\boxed{3 + 4 = 7}", "7"),
        (r"\boxed{1,234}", "1234"),
        (r"\boxed{x = 5, y = 7}", "7"),  # no list of numbers
        ("\\boxed{25 cm\u00b2}", "25"),
        ("10\u00b2", "10"),  # a superscript is no digit: not "2", not "102"
        ("1, 5", "5"),
        ("[8, 0]", "0"),  # unboxed: the last number, as before
    ],
)
def test_integer_answer_reads_no_list_as_a_number(completion, answer):
    assert rewards.integer_answer(completion) == answer


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        (r"\boxed{2\cdot 3}", "3", 0.0),  # an expression is never read as its last number: was 1
        (r"\boxed{2 \times 3}", "3", 0.0),
        (r"\boxed{10^2}", "2", 0.0),
        (r"\boxed{3-2}", "2", 0.0),  # the minus is an operator here, not a sign
        (r"\boxed{3 + x}", "3", 0.0),
        (r"The product is 2*3", "3", 0.0),
        (r"\boxed{x = -3}", "-3", 1.0),  # a sign, an equation's value: still read
        (r"\boxed{2 \cdot 3 = 6}", "6", 1.0),
        ("5 - 8 = \u22123", "-3", 1.0),
        ("The answer is -3", "-3", 1.0),
    ],
)
def test_an_expression_is_never_read_as_its_last_number(completion, gold, score):
    assert integer_reward(completion, gold) == score


@pytest.mark.parametrize("fullwidth, ascii_text", [("\uff0d\uff15", "-5"), ("\uff15", "5"), ("\uff11\uff12", "12")])
def test_every_verifier_reads_fullwidth_forms_as_ascii(fullwidth, ascii_text):
    """One normaliser (final_answer, through plumbing.cli.plain) for every verifier: math-verify scored these 0."""
    assert math_reward(f"\\boxed{{{fullwidth}}}", ascii_text) == 1.0
    assert math_reward(f"\\boxed{{{ascii_text}}}", fullwidth) == 1.0  # a gold is read the same way
    assert integer_reward(f"\\boxed{{{fullwidth}}}", ascii_text) == 1.0
    assert similarity_reward(fullwidth, ascii_text) == 1.0
    assert countdown_reward("\\boxed{\uff13\uff0b\uff15}", [3, 5], 8) == 1.0  # fullwidth 3+5


def test_format_reward():
    assert format_reward("<think>add them</think> 12") == 1.0
    assert format_reward("  <think>add</think>\n<answer>12</answer>") == 1.0
    assert format_reward("<think> </think> 12") == 0.0  # empty thinking
    assert format_reward("<think>add</think>  ") == 0.0  # empty answer
    assert format_reward("12") == 0.0
    assert format_reward("<think>a</think><think>b</think> 12") == 0.0  # two think blocks
    assert format_reward("hi <think>a</think> 12") == 0.0  # text before the thinking
    assert format_reward("</think> 12 <think>a") == 0.0


def test_reward_terms_take_the_completion_and_the_example():
    """--reward-weights' terms: each (completion, example) -> float, reading what it needs from the example."""
    from types import SimpleNamespace

    assert {"sim", "format"} <= set(rewards.REWARD_TERMS)  # a fork may add its own terms
    assert "exact" not in rewards.REWARD_TERMS  # "exact" is each task's verifier (tasks.Task.reward)
    example = SimpleNamespace(reference="The council approved the lease.", gold=None, meta={})
    sim, fmt = rewards.REWARD_TERMS["sim"], rewards.REWARD_TERMS["format"]
    assert sim("<think>x</think>The council approved the lease.", example) == 1.0
    completion = "<think>x</think>The council approved it."  # pred [council, approved, it] vs 4 reference words
    assert sim(completion, example) == pytest.approx(similarity_reward(completion, example.reference))
    assert 0.0 < sim(completion, example) < 1.0
    assert fmt(completion, example) == 1.0 and fmt("The council approved it.", example) == 0.0
    assert sim("anything", SimpleNamespace(reference="", gold=None, meta={})) == 0.0  # no demonstration, no reward


# ---------------------------------------------------------------- similarity (Appendix B.5)
def test_similarity_identical_and_disjoint():
    text = "The council approved the lease for five years."
    assert similarity_reward(f"<think>hmm</think>{text}", text) == 1.0
    assert similarity_reward("apples and pears", "council lease years") == 0.0
    assert similarity_reward("", text) == 0.0
    assert similarity_reward(text, "") == 0.0  # no reference, no reward (not even for empty output)


def test_similarity_hand_computed():
    # words after SQuAD normalisation (lowercase, no punctuation, no a/an/the):
    #   completion "On the mat sat the cat."  -> [on, mat, sat, cat]
    #   reference  "The cat sat on the mat!"  -> [cat, sat, on, mat]
    # F1_SQuAD: 4 shared words, P = R = 4/4 -> F1 = 1.0
    # ROUGE-L: LCS = [on, mat] = 2, P = R = 2/4 -> F = 0.5
    # r_sim = 0.6 * 1.0 + 0.4 * 0.5 = 0.8
    assert similarity_reward("<think>x</think> On the mat sat the cat.", "The cat sat on the mat!") == (
        pytest.approx(0.8)
    )
    # completion [cat, sat] vs reference [cat, sat, on, mat]: P = 1, R = 1/2 for both halves
    # -> F1 = ROUGE-L F = 2 * 1 * 0.5 / 1.5 = 2/3, so r_sim = 2/3
    assert similarity_reward("A CAT, sat.", "The cat sat on the mat") == pytest.approx(2 / 3)


def test_squad_words():
    assert squad_words("The Cat's  hat, an apple & A pear!") == ["cats", "hat", "apple", "pear"]


def test_lcs_matches_dynamic_programming():
    def lcs_table(a, b):
        previous = [0] * (len(b) + 1)
        for x in a:
            current = [0]
            for j, y in enumerate(b):
                current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
            previous = current
        return previous[-1]

    rng = random.Random(0)
    for _ in range(300):
        a = [rng.choice("abcd") for _ in range(rng.randint(0, 15))]
        b = [rng.choice("abcd") for _ in range(rng.randint(0, 15))]
        assert lcs_length(a, b) == lcs_table(a, b)


def test_rouge_half_agrees_with_rouge_score_on_normalised_text():
    # on already normalised text rouge-score's tokenizer sees the same words as ours, so the ROUGE-L
    # half recovered as (r_sim - 0.6 * F1) / 0.4 must equal rouge-score's ROUGE-L F-measure
    pred, ref = "cat sat on mat near door", "door cat was on mat"
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rouge = scorer.score(ref, pred)["rougeL"].fmeasure
    overlap = 4  # cat, on, mat, door
    f1 = 2 * (overlap / 6) * (overlap / 5) / (overlap / 6 + overlap / 5)
    assert (similarity_reward(pred, ref) - 0.6 * f1) / 0.4 == pytest.approx(rouge)


# ---------------------------------------------------------------- adversarial corpus
def adversarial_corpus(sentinel):
    """Hostile completions; none may score, raise, hang or touch `sentinel`."""
    return [
        f"__import__('os').system('touch {sentinel}')",
        rf"\boxed{{__import__('os').system('touch {sentinel}')}}",
        f"open('{sentinel}', 'w').write('x')",
        "exec(\"open('x','w')\")",
        "9**9**9**9",
        r"\boxed{9^{9^{9^{9}}}}",
        "(" * 10_000 + "1" + ")" * 10_000,
        "{" * 10_000 + "}" * 5,
        r"\boxed{" * 5_000,
        "x" * 1_000_000,
        "<think>" * 1_000 + "</think>" * 1_000,
        bytes(range(256)).decode("utf-8", errors="replace") * 100,
        b"\xff\xfe\x80abc\xc3(".decode("utf-8", errors="replace"),
        "\udcff\udcfe lone surrogates",
        "\x00" * 1000,
        "lambda: 0",
        "().__class__.__bases__[0].__subclasses__()",
        "1/0",
    ]


def test_adversarial_corpus_scores_zero_without_side_effects(tmp_path):
    sentinel = tmp_path / "pwned"
    for text in adversarial_corpus(sentinel):
        assert math_reward(text, "24") == 0.0, text[:60]
        assert countdown_reward(text, [9, 9, 9, 9], 24) == 0.0, text[:60]
        assert countdown_reward(text, [1, 2, 3, 4], 24) == 0.0, text[:60]
        assert integer_reward(text, "24") == 0.0, text[:60]
        assert similarity_reward(text, "The council approved the lease.") == 0.0, text[:60]
        assert format_reward(text) == 0.0, text[:60]
    assert not sentinel.exists()


def test_rewards_accept_any_input_type(monkeypatch):
    monkeypatch.setattr(rewards, "STRICT", True)
    for junk in [None, 42, b"\xff\xfe", ["a"], 3.5]:
        for score in [
            math_reward(junk, "1"),
            countdown_reward(junk, [1], 1),
            integer_reward(junk, "1"),
            similarity_reward(junk, "a b"),
            format_reward(junk),
        ]:
            assert score == 0.0
    # A numbers list that is not list[int] is a data bug that the data gate refuses, naming its line, before any
    # reward sees it (test_nothing_silent.py: test_a_countdown_value_of_the_wrong_type_is_refused_...); a reward
    # that raises anyway scores 0 and is counted (test_reward_exceptions_are_counted_and_the_first_traceback_printed).


# ---------------------------------------------------------------- verdicts decided in rewards.py's departure 4
def _long_completion(answer: str, after: int) -> str:
    """A long think-then-answer completion whose boxed answer sits `after` characters before the end."""
    check = (
        "Let me double-check each step. "
        + " ".join(f"Step {i}: {i} * 3 = {i * 3}, which is consistent." for i in range(1, 400))
    )[:after]
    return (
        f"<think>Work through it carefully. {'Adding the parts, ' * 40}</think>\n"
        f"So the result is \\boxed{{{answer}}}.\n\n{check}"
    )


@pytest.mark.parametrize("answer, gold, after", [(r"\frac{3}{4}", "0.75", 1400), ("128", "128", 3700)])
def test_math_reward_takes_the_last_box_wherever_it_is(answer, gold, after):
    completion = _long_completion(answer, after)
    assert len(completion) - completion.rfind("\\boxed") > after > rewards.MAX_ANSWER_CHARS
    assert math_reward(completion, gold) == 1.0
    assert math_reward(completion, "129") == 0.0  # the numbers after the box are not the answer


def test_math_reward_bounds_what_reaches_sympy():
    huge_box = "\\boxed{" + "1+" * 5000 + "1}"  # longer than MAX_ANSWER_CHARS: counts as no box
    assert rewards.math_answer(huge_box) == huge_box[-rewards.MAX_ANSWER_CHARS :]
    assert math_reward(huge_box, "5001") == 0.0
    assert len(rewards.math_answer("x " * 100_000)) == rewards.MAX_ANSWER_CHARS


@pytest.mark.parametrize(
    "completion",
    [
        "<think>Natalia sold 48 clips in April and half as many in May: 48 + 24 = 72",  # cut off mid-trace
        "<think>so \\boxed{72}",
        "<think>the answer is 72</think",  # the closing tag itself truncated
    ],
)
def test_unfinished_think_block_scores_zero(completion):
    assert final_answer(completion) == ""
    assert math_reward(completion, "72") == 0.0
    assert integer_reward(completion, "72") == 0.0
    assert math_reward(completion + "</think> 72", "72") == 1.0  # the same trace, finished, counts


@pytest.mark.parametrize(
    "completion",
    [
        r"\boxed{72 clips}",
        r"\boxed{\text{72 clips}}",
        r"\boxed{72 \text{clips}}",
        r"<think>x</think> She sold \boxed{72 clips in total}.",
    ],
)
def test_boxed_number_with_unit_words_is_the_number(completion):
    assert math_reward(completion, "72") == 1.0
    assert math_reward(completion, "73") == 0.0


def test_unit_words_do_not_turn_algebra_into_numbers():
    assert math_reward(r"\boxed{3x}", "3") == 0.0
    assert math_reward(r"\boxed{3 x}", "3") == 0.0  # one letter is a variable, not a unit
    assert math_reward(r"\boxed{1,200 dollars}", "1200") == 1.0


def test_unicode_minus_is_a_minus():
    assert math_reward("<think>x</think> The answer is \u22123", "-3") == 1.0
    assert math_reward("<think>x</think> The answer is \u22123", "3") == 0.0
    assert integer_reward("5 - 8 = \u22123", "-3") == 1.0


# ---------------------------------------------------------------- reward errors are visible
@rewards.safe_reward
def _buggy_reward(completion, gold) -> float:
    return float(completion == gold[5])  # IndexError for short golds: a bug in a new reward


def test_reward_exceptions_raise_in_strict_mode(monkeypatch):
    monkeypatch.setattr(rewards, "STRICT", True)
    with pytest.raises(IndexError):
        _buggy_reward("7", "72")


def test_reward_exceptions_are_counted_and_the_first_traceback_printed(monkeypatch, capsys):
    monkeypatch.setattr(rewards, "STRICT", False)
    monkeypatch.setitem(rewards._errors, "printed", False)
    rewards.take_error_count()
    assert [_buggy_reward("7", "72") for _ in range(3)] == [0.0] * 3
    assert math_reward(r"\boxed{72}", "72") == 1.0  # scoring still works and adds no error
    assert rewards.take_error_count() == 3
    assert rewards.take_error_count() == 0  # reset by reading: one count per training step
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "IndexError" in err and "_buggy_reward" in err
    _buggy_reward("7", "72")
    assert "Traceback" not in capsys.readouterr().err  # once per run
    assert rewards.take_error_count() == 1


def test_hostile_text_raises_nothing_even_in_strict_mode(monkeypatch):
    """Strict mode is usable for a whole test suite: wrong answers are 0, not exceptions."""
    monkeypatch.setattr(rewards, "STRICT", True)
    assert countdown_reward("8 / (3 - 3) * 24", [8, 3, 3, 24], 24) == 0.0  # division by zero
    assert countdown_reward("(" * 40 + "1" + ")" * 40, [1], 1) == 0.0
    assert math_reward("\\boxed{" * 300, "1") == 0.0
    assert math_reward(b"\xff\xfe", "1") == 0.0


@pytest.mark.parametrize(
    "completion, gold, want, as_math_verify",
    [
        (r"The solutions are \boxed{1} and \boxed{2} and \boxed{3}.", r"\{1,2,3\}", 1.0, True),  # math-verify's cases
        (r"\boxed{(2, 2)} \quad \text{and} \quad \boxed{(6, 2)}", "(2,2),(6,2)", 1.0, True),
        (r"$\boxed{-1}$, $\boxed{4}$", r"\{-1, 4\}", 1.0, True),
        (r"\boxed{1} and \boxed{2}", "2", 0.0, True),  # two boxes are a set of two, not the last one alone
        # words part them: the earlier box is working, not answer (math-verify would read the set {2, 3})
        (r"First \boxed{2}, so the answer is \boxed{3}", "3", 1.0, False),
        (r"\boxed{5 apples} or \boxed{7}", r"\{5, 7\}", 1.0, False),  # unit words go from each box of the run
    ],
)
def test_answers_split_over_several_boxes_are_one_set_as_math_verify_reads_them(completion, gold, want, as_math_verify):
    from math_verify import parse, verify

    assert math_reward(completion, gold) == want
    if as_math_verify:
        assert float(verify(parse("\\boxed{" + gold + "}"), parse(completion))) == want
    assert rewards.last_box_run(r"\boxed{1}, \boxed{2}", 99) == (["1", "2"], 20)
    assert rewards.last_box_run(r"\boxed{2", 99) == ([], -1)


# ---------------------------------------------------------------- math-verify's own cases (docs/rewards.md, note 1)
NOTE = "[Note: it is always a good idea to double-check the calculations.] "


@pytest.mark.parametrize(
    "completion, gold, want",
    [
        ("1.22", "1,22", 1.0),  # a bare gold with a decimal comma, as math-verify reads it unboxed (boxed: a pair)
        ("0.111", "0,111", 1.0),  # a leading 0 is never a thousands group
        ("7425000", "7,425,000", 1.0),  # thousands separators
        ("1.22", "1,220", 0.0),  # 1,220 is thousands: 1220
        # an unboxed final answer stated long before the end of a rambling answer
        (
            "So N = 14916. Final Answer: The final answer is $14 {,}916$. I hope it is correct. " + NOTE * 30,
            r"\boxed{14{,}916}",
            1.0,
        ),
        # a statement after the last box is the answer; the boxes before it were working
        (
            r"Interest: $0.05 \cdot 10,200 / 2 = \boxed{255}$, so she has $10,455. The final answer is $10,455$. Done.",
            "10455",
            1.0,
        ),
        (r"The final answer is $5$. Wait, recount: \boxed{7}", "7", 1.0),  # a box after the statement wins
        # answers boxed in parts are one answer
        (r"$$\boxed{(3, 3)} \text{ for part (a) and } \boxed{(1, 1)}$$", "(3, 3), (1, 1)", 1.0),
        (
            r"\(y_1 = \boxed{-2(x - 1)^2 + 5} \) and \( y_2 = \boxed{3(x + 2)^2 - 2} \)",
            "y_{1}=-2 x^{2}+4 x+3, y_{2}=3 x^{2}+12 x+10",
            1.0,
        ),
        (r"\(y_1 = \boxed{-2(x - 1)^2 + 5} \) and \( y_2 = \boxed{3(x + 2)^2 - 2} \)", "-2x^2+4x+3", 0.0),
    ],
)
def test_math_answers_math_verify_finds_are_found(completion, gold, want):
    assert math_reward(completion, gold) == want


@pytest.mark.parametrize(
    "completion, gold, why",
    [
        ("Answer $ \n 9 \n $", "$9$", "latex-only extraction (match_types=['latex']); by default expr finds the 9"),
        ("Answer \\( \n 9 \n \\)", "$9$", "latex-only extraction (match_types=['latex']); by default expr finds the 9"),
        (
            r"$\begin{pmatrix}0.33\\0.2 \end{pmatrix}$",
            r"$(\begin{pmatrix}\frac{1}{3}\\ \frac{1}{5} \end{pmatrix})$",
            "float_rounding=2; the default rounds to 6 digits",
        ),
        ("$(0.6,2.6667]$", r"$(\frac{3}{5},\frac{8}{3}]$", "float_rounding=2; the default rounds to 6 digits"),
        (r"$-2 \le x \le 7$", r"$x \in [-2,7]$", "allow_set_relation_comp=True; off by default"),
        ("$f(y)$", "$f(x)$", "strict=False; by default x and y are different variables"),
    ],
)
def test_math_verify_cases_that_disagree_only_under_a_non_default_setting(completion, gold, why):
    """math-verify's test expects the other verdict under the setting in `why`; under its defaults it agrees."""
    from math_verify import parse, verify

    assert math_reward(completion, gold) == float(verify(parse("\\boxed{" + gold + "}"), parse(completion)))


def test_math_verify_own_error_is_not_copied():
    """math-verify's test expects 1 - 1/e to equal 1 + 1/e when the gold is not boxed; it is wrong, and so
    math_reward, which boxes the gold, keeps its 0."""
    from math_verify import parse, verify

    pred, gold = r"$1 + \frac{1}{\mathrm{e}}$", r"$1 - \frac{1}{\mathrm{e}}$"
    assert verify(parse(gold), parse(pred)) and math_reward(pred, gold) == 0.0


# ---------------------------------------------------------------- a score never depends on the machine's load
def test_a_math_verify_timeout_is_counted_and_said_once(monkeypatch, capsys):
    monkeypatch.setitem(rewards._errors, "printed", False)
    rewards.take_error_count()
    assert math_reward("9**9**9**9", "2") == 0.0  # outlasts MATH_TIMEOUT_S: the worker is killed
    assert rewards.take_error_count() == 1
    err = capsys.readouterr().err
    assert (
        f"took over {rewards.MATH_TIMEOUT_S:g} CPU seconds and scored 0" in err and len(err.strip().splitlines()) == 1
    )
    assert math_reward(r"\boxed{2}", "2") == 1.0 and rewards.take_error_count() == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="CPU seconds are read from Linux /proc")
def test_a_worker_held_off_the_cpu_past_the_timeout_still_answers():
    """The timeout counts the worker's CPU seconds, not the clock's: a stopped worker stands in for a loaded
    machine, where a correct answer used to score 0 after MATH_TIMEOUT_S of waiting for a core."""
    failures = []
    worker = rewards.MathWorker(timeout=1.0, on_failure=failures.append)
    try:
        assert worker.verify(r"\boxed{2}", r"\boxed{2}") == 1.0  # started and warm
        os.kill(worker.active.pid, signal.SIGSTOP)
        threading.Timer(2.5, os.kill, (worker.active.pid, signal.SIGCONT)).start()
        assert worker.verify(r"\boxed{3}", r"\boxed{3}") == 1.0  # 2.5 s on the clock, ~0 on the CPU
        assert failures == []
    finally:
        worker.close()


def test_deep_nesting_scores_the_same_in_a_fresh_worker_as_in_a_warm_one(monkeypatch):
    """Too deep: 0 by rule, without parsing (its parse alone took 7.7 s at 30 levels). Within MAX_DEPTH: parsed,
    with room under the timeout, in a fresh worker whose cache has never seen it."""
    deep = "\\boxed{" + "(" * 30 + "1" + ")" * 30 + "}"
    allowed = "\\boxed{" + "(" * (rewards.MAX_DEPTH - 2) + "2" + ")" * (rewards.MAX_DEPTH - 2) + "}"
    rewards.take_error_count()
    assert math_reward(deep, "1") == 0.0 and math_reward(allowed, "2") == 1.0  # the run's worker, warm
    fresh = rewards.MathWorker(timeout=rewards.MATH_TIMEOUT_S, on_failure=rewards._count_error)
    monkeypatch.setattr(rewards, "_math_worker", fresh)
    assert math_reward(deep, "1") == 0.0 and math_reward(allowed, "2") == 1.0  # a fresh one: the same scores
    fresh.close()
    assert rewards.take_error_count() == 0
