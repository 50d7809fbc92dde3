"""judge.py: parsing hand-written judge answers, the statistics, and the judge path end to end.

The fast tests drive a scripted OpenAI-compatible server (tests/judge_servers.py); the slow one starts
a real vLLM server from .venv-vllm on the tiny model and runs `eval.py --judge-url` against it.

    python -m pytest tests/test_judge.py -q
"""

import json
import os
import shutil
import time

import pytest
from judge_servers import VLLM_PYTHON, ScriptedServer, VLLMServer, free_port

import eval as eval_py
from tools import judge
from tools.judge import Judge, judge_result, parse_criteria, parse_preference, parse_score

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POEMS = os.path.join(ROOT, "tests", "fixtures", "poems.jsonl")


# ---------------------------------------------------------------- parsing hand-written answers
@pytest.mark.parametrize(
    "raw, expected",
    [
        ("The imagery is vivid and the rhyme holds.\nScore: 82", 82.0),
        ("**Score:** 75/100", 75.0),
        ("Score = 64.5", 64.5),
        ("  91  ", 91.0),  # a bare number as the whole answer
        ("Score: 0", 0.0),
        ("Score: 100", 100.0),
        ("Final score: 85", 85.0),
        ("Overall, a fine poem.\nScore: 85 (out of 100)", 85.0),
        # reasoning that names other numbers and a first verdict, then ends in the score
        (
            "<think>Line 3 stumbles. A 40 seems harsh; maybe Score: 60.</think>\nStrong images, weak meter.\nScore: 72",
            72.0,
        ),
        (
            "Let me weigh it. The first stanza is a 9 out of 10 for imagery, the rest weaker.\n"
            "I first thought 55.\nScore: 60\nOn reflection the ending lifts it.\nScore: 68",
            68.0,
        ),
    ],
)
def test_parse_score_valid(raw, expected):
    assert parse_score(raw) == (expected, "ok")


@pytest.mark.parametrize(
    "raw, status",
    [
        ("Score: 120", "out of range"),
        ("Score: -5", "out of range"),
        ("Score: 70 or 80", "two numbers"),
        ("Score: 70-80", "two numbers"),
        ("70 80", "no score"),
        ("Score: 8/10", "other scale (8/10)"),
        ("Score: 8 out of 10", "other scale (8 out of 10)"),
        ("I'm sorry, but I can't evaluate this poem.", "no score"),
        ("As an AI I do not give numeric ratings to creative work.", "no score"),
        ("Score: N/A", "no score"),
        ("<think>It deserves Score: 80</think>\nI would rather not say.", "no score"),  # the verdict is after </think>
        ("", "no score"),
    ],
)
def test_parse_score_failures_are_none_not_zero(raw, status):
    assert parse_score(raw) == (None, status)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("Score: \u221215", (None, "out of range")),  # U+2212 minus: was (15.0, "ok")
        ("Score: \u221280/100", (None, "out of range")),  # was (80.0, "ok")
        ("Score: \u221280 out of 100", (None, "out of range")),
        ("\u221215", (None, "out of range")),  # a bare answer: was "no score"
        ("Score: \ufe6315", (None, "out of range")),  # small and fullwidth hyphen-minus (NFKC): were 15, "ok"
        ("Score: \uff0d15", (None, "out of range")),
        ("Score: [8, 0]", (None, "two numbers")),  # a list is never one number
        ("Score: 8,0", (None, "two numbers")),
        ("Score: (8; 0)", (None, "two numbers")),
        ("Score: \uff18\uff10", (80.0, "ok")),  # fullwidth digits are digits
        ("Score: \uff18\uff10/\uff11\uff10\uff10", (80.0, "ok")),
        ("Score: \uff18/\uff11\uff10", (None, "other scale (8/10)")),
    ],
)
def test_parse_score_reads_unicode_signs_and_digits_and_no_list(raw, expected):
    assert parse_score(raw) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("Poem B has fresher images.\nPreference: B", ("B", "ok")),
        ("**Preference:** A", ("A", "ok")),
        ("They are equally good.\nPreference: Tie", ("tie", "ok")),
        ("Preference: A or B", (None, "two preferences")),
        ("I cannot compare poems.", (None, "no preference")),
        ("Preference: neither", (None, "no preference")),
    ],
)
def test_parse_preference(raw, expected):
    assert parse_preference(raw) == expected


MEETING_ANSWER = (
    "The summary covers the vote.\nInformativeness: 70\nFactuality: 90\nFluency: 85\n"
    "Coherence: 80\nConciseness: 75\nOverall: 78"
)


def test_parse_criteria():
    scores, status = parse_criteria(MEETING_ANSWER)
    assert status == "ok"
    assert scores == {
        "informativeness": 70,
        "factuality": 90,
        "fluency": 85,
        "coherence": 80,
        "conciseness": 75,
        "overall": 78,
    }
    assert parse_criteria(MEETING_ANSWER.replace("Overall: 78", "**Overall score:** 78/100")) == (scores, "ok")
    scores, status = parse_criteria(MEETING_ANSWER.replace("Overall: 78", "Overall: good"))
    assert status == "overall: no score" and scores["overall"] is None and scores["fluency"] == 85
    assert parse_criteria(MEETING_ANSWER.replace("Factuality: 90", "Factuality: 190"))[1] == "factuality: out of range"


# ---------------------------------------------------------------- statistics, by hand
def test_spearman_by_hand():
    assert judge.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # 1 - 6 * 2 / (4 * 15)
    assert judge.spearman([10, 20, 30], [3, 2, 1]) == pytest.approx(-1.0)
    # ties share ranks: x ranks (1, 2.5, 2.5, 4), y ranks (1, 2, 3, 4): 4.5 / sqrt(4.5 * 5)
    assert judge.spearman([1, 2, 2, 3], [5, 6, 7, 8]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert judge.spearman([5, 5, 5], [1, 2, 3]) is None  # a constant side has no ranking


def test_mean_ci95_by_hand():
    mean, low, high = judge.mean_ci95([60, 70, 80])  # sd 10, t(0.975, 2 df) = 4.303
    assert mean == 70 and low == pytest.approx(70 - 4.303 * 10 / 3**0.5)
    assert high == pytest.approx(70 + 4.303 * 10 / 3**0.5)
    assert judge.mean_ci95([50]) == (50, None, None) and judge.mean_ci95([]) == (None, None, None)
    mean, low, high = judge.mean_ci95([0, 100] * 50)  # 99 df: t = 1.984 (tables)
    assert high - mean == pytest.approx(1.984 * (100 * 100 / 4 * 100 / 99) ** 0.5 / 10, rel=1e-3)


# ---------------------------------------------------------------- end to end on a scripted server
POETRY = [
    ("Write a poem about fog.", "Fog on the quay, the masts are gone.", "The fog comes soft across the quay"),
    ("Write a haiku about snow.", "I cannot write poems.", "First snow on the roofs"),
    ("Write a poem about rain.", "Rain drums the tin roof all night long.", "A thousand fingers tapping tin"),
    ("Write a poem about a cat.", "The cat sleeps in a patch of sun, content.", "My cat declared on Monday"),
]


def poetry_result(completions=None):
    examples = [
        {
            "uid": f"poetry-{i}",
            "prompt": [{"role": "system", "content": "You write poetry."}, {"role": "user", "content": instruction}],
            "reference": reference,
            "completion": f"<think>plan</think>{poem}",
        }
        for i, (instruction, poem, reference) in enumerate(POETRY)
    ]
    for example, completion in zip(examples, completions or []):
        example["completion"] = completion
    return {"summary": {"task": "poetry", "n": len(examples)}, "examples": examples}


def poetry_judge(model, messages):
    """A judge that scores by poem length (judge-b: length mod 37), refuses the non-poem, prefers poem A."""
    text = messages[-1]["content"]
    if "Poem A:" in text:
        return "A is better.\nPreference: A"
    poem = text.split("The model's poem:\n")[1].split("\n\nRate the poem")[0]
    if "cannot" in poem:
        return "I'm sorry, I can't rate this."
    return f"Reasoning about {len(poem)} characters.\nScore: {len(poem) % 37 if model == 'judge-b' else len(poem)}"


def test_poetry_end_to_end_with_resume(tmp_path):
    path = str(tmp_path / "eval_poetry_test.json")
    with ScriptedServer(poetry_judge) as server:
        judges = [Judge(server.url, "judge", retries=0)]
        summary = judge_result(poetry_result(), judges, path, progress=False)
        assert len(server.requests) == 8  # 4 examples x (isolated score + pairwise)
        saved = json.load(open(path))
        for example, (instruction, poem, reference) in zip(saved["examples"], POETRY):
            score, pairwise = example["judge"]["judge"]["score"], example["judge"]["judge"]["pairwise"]
            assert poem in score["prompt"][-1]["content"] and instruction in score["prompt"][-1]["content"]
            assert "plan" not in score["prompt"][-1]["content"]  # the thinking is not judged
            assert reference in pairwise["prompt"][-1]["content"] and poem in pairwise["prompt"][-1]["content"]
            assert score["raw"] and pairwise["parsed"]["preference"] == "A"
            if "cannot" in poem:
                assert score["status"] == "no score" and score["parsed"]["score"] is None  # never a silent 0
            else:
                assert score["status"] == "ok" and score["parsed"]["score"] == len(poem)
        row = summary["judges"]["judge"]
        scored = [len(p) for _, p, _ in POETRY if "cannot" not in p]
        assert row["score_mean"] == pytest.approx(sum(scored) / 3) and row["n_scored"] == 3
        assert row["score/parse_failures"] == 1 and row["score/parse_failure_rate"] == pytest.approx(0.25)
        # the judge always says A: the model wins exactly where its poem was shown first
        firsts = [judge._candidate_first(f"poetry-{i}") for i in range(4)]
        assert row["win_rate"] == pytest.approx(sum(firsts) / 4) and 0 < sum(firsts) < 4
        assert saved["judge_summary"] == summary

        # a rerun on freshly generated (identical) outputs asks nothing again
        again = judge_result(poetry_result(), judges, path, progress=False)
        assert len(server.requests) == 8 and again == summary
        # a changed completion is judged again, the other three are not
        changed = poetry_result([f"<think>plan</think>{POETRY[0][1]} The gulls are quiet."])
        judge_result(changed, judges, path, progress=False)
        assert len(server.requests) == 10
        assert "The gulls are quiet." in server.requests[-1][1][-1]["content"]


def test_meetingbank_criteria(tmp_path):
    answers = iter([MEETING_ANSWER, "Summary is fine.\nOverall: 60"])  # the second lacks five criteria
    result = {
        "summary": {"task": "meetingbank"},
        "examples": [
            {
                "uid": f"mb-{i}",
                "prompt": [{"role": "user", "content": "Summarize: Speaker 1: motion carries."}],
                "reference": "motion carries",
                "completion": "The council passed the motion.",
            }
            for i in range(2)
        ],
    }
    with ScriptedServer(lambda model, messages: next(answers)) as server:
        summary = judge_result(
            result, [Judge(server.url, "judge", retries=0)], str(tmp_path / "mb.json"), concurrency=1, progress=False
        )
        assert "Speaker 1: motion carries." in server.requests[0][1][-1]["content"]
        assert "motion carries" in server.requests[0][1][-1]["content"].split("Reference notes")[1]
    statuses = [ex["judge"]["judge"]["criteria"]["status"] for ex in result["examples"]]
    assert statuses == ["ok", "informativeness: no score"]
    row = summary["judges"]["judge"]
    assert row["score_mean"] == 78 and row["factuality_mean"] == 90 and row["criteria/parse_failures"] == 1


def test_concurrency_is_bounded(tmp_path):
    with ScriptedServer(poetry_judge, delay=0.3) as server:
        judge_result(
            poetry_result(),
            [Judge(server.url, "judge", retries=0)],
            str(tmp_path / "o.json"),
            concurrency=3,
            progress=False,
        )
        assert len(server.requests) == 8
        assert 2 <= server.max_in_flight <= 3


def test_retries_then_resume_after_failure(tmp_path):
    path = str(tmp_path / "o.json")
    calls = {"n": 0}

    def flaky(model, messages):  # the first request gets a 503; the client retries it
        calls["n"] += 1
        return 503 if calls["n"] == 1 else poetry_judge(model, messages)

    with ScriptedServer(flaky) as server:
        judge_result(poetry_result(), [Judge(server.url, "judge", retries=2)], path, progress=False)
        assert len(server.requests) == 9  # 8 judgments + the one retried

    def down_for_rain(model, messages):  # one example keeps failing: the run stops, the rest is kept
        return 500 if "rain" in messages[-1]["content"] else poetry_judge(model, messages)

    path = str(tmp_path / "p.json")
    with ScriptedServer(down_for_rain) as server:
        with pytest.raises(judge.JudgeError, match="rerun the same command"):
            judge_result(poetry_result(), [Judge(server.url, "judge", retries=1)], path, concurrency=1, progress=False)
        saved = json.load(open(path))
        judged = sum(len(ex["judge"]["judge"]) for ex in saved["examples"])
        assert 0 < judged < 8 and not saved["examples"][2]["judge"]["judge"]  # example 2 is the rain poem
    with ScriptedServer(poetry_judge) as server:  # back up: only what is missing is asked
        judge_result(poetry_result(), [Judge(server.url, "judge", retries=0)], path, progress=False)
        assert len(server.requests) == 8 - judged


def test_a_server_that_trickles_its_answer_times_out_per_request(tmp_path):
    """--judge-timeout bounds each whole request: a server sending a byte every 0.2 s (each read well inside the
    timeout) used to hold the run for as long as it kept sending."""
    with ScriptedServer(poetry_judge, trickle=0.2) as server:
        started = time.monotonic()
        with pytest.raises(judge.JudgeError, match="TimeoutError.*judge-timeout 1 s.*rerun the same command"):
            judge_result(
                poetry_result(),
                [Judge(server.url, "judge", timeout=1.0, retries=1)],
                str(tmp_path / "o.json"),
                concurrency=1,
                progress=False,
            )
        elapsed = time.monotonic() - started
        assert len(server.requests) == 2  # the first try and its one retry
    assert elapsed < 10  # two tries of 1 s and a 0.5 s backoff; the answer alone would take a minute or more


def test_rejected_request_is_reported_not_retried(tmp_path):
    def too_long_for_rain(model, messages):  # 400: e.g. a prompt over the judge's context; final, not retried
        return 400 if "rain" in messages[-1]["content"] else poetry_judge(model, messages)

    with ScriptedServer(too_long_for_rain) as server:
        summary = judge_result(
            poetry_result(), [Judge(server.url, "judge", retries=3)], str(tmp_path / "o.json"), progress=False
        )
        assert len(server.requests) == 8
    saved = json.load(open(tmp_path / "o.json"))
    rain = saved["examples"][2]["judge"]["judge"]
    assert rain["score"]["status"].startswith("rejected: ") and rain["score"]["parsed"]["score"] is None
    row = summary["judges"]["judge"]
    assert row["score/rejected"] == 1 and row["score/parse_failures"] == 1  # the refusal
    assert row["score/parse_failure_rate"] == pytest.approx(1 / 3) and row["n_scored"] == 2


def test_two_judges_spearman_and_methods(tmp_path):
    with ScriptedServer(poetry_judge, models=("judge-a", "judge-b")) as server:
        judges = [Judge(server.url, "judge-a", retries=0), Judge(server.url, "judge-b", retries=0)]
        # the paper's order: the primary judge first, the second judge on the same file later
        judge_result(poetry_result(), judges[:1], str(tmp_path / "a.json"), progress=False)
        judge_result(poetry_result(), judges[1:], str(tmp_path / "a.json"), progress=False)
        assert [model for model, _ in server.requests] == ["judge-a"] * 8 + ["judge-b"] * 8
        first = judge_result(poetry_result(), judges, str(tmp_path / "a.json"), progress=False)
        assert len(server.requests) == 16  # both judges' judgments were kept: nothing asked again
        other = poetry_result([f"<think></think>{'x' * n}" for n in (5, 50, 20, 30)])
        judge_result(other, judges, str(tmp_path / "b.json"), progress=False)
    # the three scored poems have 36, 39, 42 characters: judge-a ranks them 1 2 3, judge-b (36, 2, 5) 3 1 2,
    # so rho = 1 - 6 * (4 + 1 + 1) / (3 * 8) = -0.5
    assert first["spearman/judge-a vs judge-b"] == pytest.approx(-0.5) and first["spearman_n/judge-a vs judge-b"] == 3
    assert first["judges"]["judge-b"]["score_mean"] == pytest.approx((36 + 2 + 5) / 3)
    # methods: judge-a puts base (39.0) over tuned (26.25), judge-b tuned (17.0) over base (14.3)
    table = judge.compare_methods({"base": json.load(open(tmp_path / "a.json")), "tuned": other}, judges)
    assert table["methods"]["tuned"] == pytest.approx(
        {"judge-a": (5 + 50 + 20 + 30) / 4, "judge-b": (5 + 13 + 20 + 30) / 4}
    )
    assert table["spearman/judge-a vs judge-b"] == pytest.approx(-1.0)


def test_unreachable_server_is_one_line_and_exit_1(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"
    path = tmp_path / "eval_poetry_test.json"
    path.write_text(json.dumps(poetry_result()))
    with pytest.raises(SystemExit) as exit_info:
        judge.main([str(path), "--judge-url", url, "--judge-model", "m", "--judge-retries", "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and url in err and len(err.strip().splitlines()) == 1
    # eval.py checks the judge before it loads a model: the missing model is never reached
    with pytest.raises(SystemExit) as exit_info:
        eval_py.main(
            [
                "--model",
                str(tmp_path / "no-model"),
                "--task",
                "poetry",
                "--data-file",
                POEMS,
                "--split",
                "train",  # its 6 poems hash to train: a test split with none is refused first
                "--judge-url",
                url,
                "--judge-model",
                "m",
                "--judge-retries",
                "0",
            ]
        )
    err = capsys.readouterr().err  # (datasets may draw a progress bar above it)
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"eval.py: error: cannot reach the judge server at {url}")


def test_a_failing_judge_leaves_an_earlier_eval_result_byte_identical(tiny_model_dir, tmp_path, capsys):
    """eval.py writes --out only once the whole result, judgments included, is in: a judge that fails
    keeps the earlier file whole, and what it answered waits beside it for the rerun, which asks only the rest."""
    out = tmp_path / "eval_poetry_train.json"
    partial = tmp_path / "eval_poetry_train.json.partial"
    argv = [
        "--model",
        tiny_model_dir,
        "--task",
        "poetry",
        "--data-file",
        POEMS,
        "--split",
        "train",
        "--limit",
        "3",
        "--max-tokens",
        "4",
        "--sampler",
        "hf",
        "--out",
        str(out),
        "--judge-retries",
        "0",
        "--judge-concurrency",
        "1",
    ]
    with ScriptedServer(poetry_judge, models=("judge", "other")) as server:
        eval_py.main(argv + ["--judge-url", server.url, "--judge-model", "judge"])
        assert len(server.requests) == 6 and not partial.exists()  # 3 examples x (score + pairwise)
    earlier = out.read_bytes()
    capsys.readouterr()

    calls = {"n": 0}

    def fails_after_two(model, messages):  # a second judge whose server breaks down mid-run
        calls["n"] += 1
        return 500 if calls["n"] > 2 else poetry_judge(model, messages)

    with ScriptedServer(fails_after_two, models=("judge", "other")) as server:
        with pytest.raises(SystemExit) as exit_info:
            eval_py.main(argv + ["--judge-url", server.url, "--judge-model", "other"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("eval.py: error: 1 judge request(s) failed")
    assert str(partial) in err and out.read_bytes() == earlier  # the earlier result and its judgments are whole
    with ScriptedServer(poetry_judge, models=("judge", "other")) as server:  # back up: only the missing are asked
        result = eval_py.main(argv + ["--judge-url", server.url, "--judge-model", "other"])
        assert len(server.requests) == 6 - 2
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result)) and not partial.exists()
    assert all(set(ex["judge"]) == {"judge", "other"} for ex in saved["examples"])  # the first judge's are kept
    assert [ex["judge"]["judge"] for ex in saved["examples"]] == [
        ex["judge"]["judge"] for ex in json.loads(earlier)["examples"]
    ]


def test_unknown_model_and_bad_flags(tmp_path, capsys):
    with ScriptedServer(poetry_judge, models=("served",)) as server:
        with pytest.raises(judge.JudgeError, match="does not serve 'other'.*served"):
            Judge(server.url, "other").check()
    for flags, message in [
        (["--judge-url", "http://x/v1"], "go together"),
        (
            ["--judge-url", "http://x/v1", "--judge-model", "m", "--judge-key-env", "SOFTMAX_GRPO_NO_SUCH_VAR"],
            "SOFTMAX_GRPO_NO_SUCH_VAR is not set",
        ),
        (
            ["--judge-url", "a", "--judge-url", "b", "--judge-url", "c", "--judge-model", "m", "--judge-model", "n"],
            "one --judge-url per --judge-model",
        ),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            eval_py.parse_args(["--model", "m", "--task", "poetry", *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    for argv in (
        ["out.json", "--judge-model", "m"],
        ["out.json", "--judge-concurrency", "0", "--judge-url", "u", "--judge-model", "m"],
        ["--judge-url", "u"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            judge.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("judge.py: error")
    with pytest.raises(SystemExit):
        eval_py.parse_args(["--model", "m", "--task", "gsm8k", "--judge-url", "u", "--judge-model", "m"])
    assert "scores poetry, meetingbank, not gsm8k" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    with ScriptedServer(poetry_judge) as server:
        with pytest.raises(judge.JudgeError, match="cannot resume from"):
            judge_result(poetry_result(), [Judge(server.url, "judge")], str(corrupt), progress=False)


def test_key_from_env_reaches_server(tmp_path, monkeypatch):
    monkeypatch.setenv("SOFTMAX_GRPO_TEST_KEY", "sk-test-123")
    args = eval_py.parse_args(
        [
            "--model",
            "m",
            "--task",
            "poetry",
            "--judge-url",
            "u",
            "--judge-model",
            "m",
            "--judge-key-env",
            "SOFTMAX_GRPO_TEST_KEY",
        ]
    )
    assert args.judge_key_env == "SOFTMAX_GRPO_TEST_KEY"
    with ScriptedServer(poetry_judge, models=("m",)) as server:
        args.judge_url = [server.url]
        judges = judge.connect_judges(args)
        assert judges[0].client.api_key == "sk-test-123"


# ---------------------------------------------------------------- a real vLLM server (CI)
@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.exists(VLLM_PYTHON),
    reason="vLLM not available: run scripts/setup_vllm_cpu.sh (or set SOFTMAX_GRPO_VLLM_PYTHON)",
)
def test_eval_judge_against_vllm_server(tiny_model_dir, tmp_path):
    # the judge prompts are ~1000 characters, one token each for the tiny tokenizer: give the served copy
    # room (rotary positions need no trained weights)
    served = shutil.copytree(tiny_model_dir, tmp_path / "judge_model")
    config = json.loads((served / "config.json").read_text())
    (served / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    log = tmp_path / "vllm_server.log"
    out = str(tmp_path / "eval_poetry_train.json")
    argv = [
        "--model",
        tiny_model_dir,
        "--task",
        "poetry",
        "--data-file",
        POEMS,
        "--split",
        "train",
        "--limit",
        "3",
        "--max-tokens",
        "16",
        "--sampler",
        "hf",
        "--out",
        out,
    ]
    judge_flags = ["--judge-model", "tiny-judge", "--judge-max-tokens", "16", "--judge-concurrency", "2"]

    def chat_requests():
        return log.read_text().count("POST /v1/chat/completions")

    with VLLMServer(str(served), "tiny-judge", str(log)) as server:
        generated = eval_py.main(argv)  # the outputs to judge, generated while the server starts
        print(f"vLLM server up in {server.wait_until_up():.1f} s")
        judge.main([out, "--judge-url", server.url, *judge_flags])
        assert chat_requests() == 6  # 3 examples x (isolated score + pairwise)
        first = json.load(open(out))
        assert [ex["completion"] for ex in first["examples"]] == [ex["completion"] for ex in generated["examples"]]
        judgments = [j for ex in first["examples"] for j in ex["judge"]["tiny-judge"].values()]
        assert len(judgments) == 6
        for j in judgments:
            assert j["prompt"][0]["role"] == "system" and "Write" in j["prompt"][-1]["content"]
            assert isinstance(j["raw"], str) and j["finish_reason"] in ("stop", "length")
            if j["status"] != "ok":  # the parse-failure path: reported, and no number stands in for it
                assert all(v is None for k, v in j["parsed"].items() if k in ("score", "preference", "outcome"))
        row = first["judge_summary"]["judges"]["tiny-judge"]
        failures = row["score/parse_failures"] + row["pairwise/parse_failures"]
        print(f"tiny judge parse failures: {failures}/6")
        assert row["score/asked"] == row["pairwise/asked"] == 3 and failures >= 1  # random weights rarely parse
        assert row["n_scored"] == 3 - row["score/parse_failures"]

        # eval.py --judge-url on the same --out regenerates the same greedy outputs and asks nothing again
        second = eval_py.main(argv + ["--judge-url", server.url, *judge_flags])
        assert chat_requests() == 6
        assert [ex["judge"] for ex in second["examples"]] == [ex["judge"] for ex in first["examples"]]

        saved = json.load(open(out))  # drop one example's judgments: only those two are asked again
        saved["examples"][1]["judge"] = {}
        json.dump(saved, open(out, "w"))
        judge.main([out, "--judge-url", server.url, *judge_flags])
        assert chat_requests() == 8
        third = json.load(open(out))
        assert third["examples"][0]["judge"] == first["examples"][0]["judge"]
        assert set(third["examples"][1]["judge"]["tiny-judge"]) == {"score", "pairwise"}


@pytest.mark.parametrize(
    "content_type, body",
    [
        ("application/json", b"<html>not json</html>"),
        ("text/html", b"<html>a login page</html>"),
        ("application/json", b'{"data": 3}'),
    ],
)
def test_a_models_listing_that_is_not_json_is_one_line(content_type, body, tmp_path, capsys):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        with pytest.raises(judge.JudgeError, match="answered GET /models with no OpenAI model list") as info:
            Judge(url, "m").check()
        assert "\n" not in str(info.value)
        path = tmp_path / "eval_poetry_test.json"
        path.write_text(json.dumps(poetry_result()))
        before = path.read_bytes()
        with pytest.raises(SystemExit) as exit_info:
            judge.main([str(path), "--judge-url", url, "--judge-model", "m", "--judge-retries", "0"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert path.read_bytes() == before
    finally:
        server.shutdown()
        server.server_close()
