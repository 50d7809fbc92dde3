"""LLM judge for Poetry and MeetingBank (SoftmaxGRPO Section 5.1, Appendix B.3-B.4, Tables 4 and B.4).

Scores eval.py's greedy completions through any OpenAI-compatible chat endpoint (`vllm serve MODEL`,
or a hosted API). Poetry gets an isolated 0-100 score and a pairwise preference against the reference
poem; MeetingBank gets informativeness, factuality, fluency, coherence and conciseness, then an overall
score, all 0-100. Every judgment is written into the eval JSON beside its example: the prompt sent, the
raw answer, the parsed score(s) and the parse status. A second judge (a second --judge-model or
--judge-url) re-scores the same outputs and the summary adds the Spearman rank correlation between
judges (Table B.4); given several eval files (one per method), the methods' mean scores are ranked
under each judge and those rankings are correlated too.

    python eval.py --model runs/poetry/checkpoint-200 --task poetry --data-file poems.jsonl \
        --judge-url http://127.0.0.1:8000/v1 --judge-model Qwen/Qwen3-30B-A3B-Thinking-2507
    python -m tools.judge runs/*/eval_poetry_test.json --judge-url URL --judge-model A --judge-model B

A rerun with the same eval file skips every judgment already there for the same judge and prompt.

Departures from the paper:
1. The paper's rubric prompts (Figures B.1, B.2) are not in its text; RUBRICS below are written for
   this project from its description of them.
2. The pairwise comparison puts the model's poem first or second by a hash of the example id, so a
   judge's position bias averages out over a test set instead of favouring one side.
"""

import argparse
import hashlib
import json
import math
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from plumbing.cli import OneLineParser, first_line, number, plain
from plumbing.files import write_json
from rewards import final_answer

# ---------------------------------------------------------------- rubrics (the judge prompts)
JUDGE_SYSTEM = "You are a careful, strict and impartial judge of writing quality."

POETRY_SCORE = """\
A model was asked to write a poem. Judge the poem it wrote.

Instruction given to the model:
{request}

The model's poem:
{candidate}

Rate the poem from 0 to 100: how well it fulfils the instruction (topic, and any form, length or style \
the instruction asks for) and its quality as a poem (imagery, word choice, sound and rhythm, originality, \
emotional effect). 0 means no poem or an off-topic answer, 50 a competent but plain poem, 100 a poem a \
skilled poet would publish. Explain briefly, then end with a last line of exactly this form:
Score: <an integer from 0 to 100>"""

POETRY_PAIRWISE = """\
Two poems were written for the same instruction. Compare them.

Instruction:
{request}

Poem A:
{poem_a}

Poem B:
{poem_b}

Which poem better fulfils the instruction and is the better poem (imagery, word choice, sound and \
rhythm, originality, emotional effect)? Do not prefer a poem for its length or its position. Explain \
briefly, then end with a last line of exactly one of these forms:
Preference: A
Preference: B
Preference: tie"""

MEETINGBANK_CRITERIA = ("informativeness", "factuality", "fluency", "coherence", "conciseness", "overall")
MEETINGBANK_SCORE = """\
A model was asked to summarize a city council meeting. Judge its summary against the transcript.

Request and transcript given to the model:
{request}

Reference notes on the meeting (a compressed transcript, for orientation; the transcript decides):
{reference}

The model's summary:
{candidate}

Score the summary from 0 to 100 on each criterion:
- Informativeness: it covers the items, decisions, votes and figures that matter.
- Factuality: every statement is supported by the transcript; nothing is invented or contradicted.
- Fluency: grammatical, readable sentences.
- Coherence: well organised; one point follows from the last.
- Conciseness: no repetition, filler or irrelevant detail.
Then give an overall score from 0 to 100 for the summary as the minutes of this meeting. Explain \
briefly, then end with exactly these six lines:
Informativeness: <0-100>
Factuality: <0-100>
Fluency: <0-100>
Coherence: <0-100>
Conciseness: <0-100>
Overall: <0-100>"""

# task -> {judgment kind: rubric}; the kind's parsed "score" is what the summary averages
RUBRICS = {
    "poetry": {"score": POETRY_SCORE, "pairwise": POETRY_PAIRWISE},
    "meetingbank": {"criteria": MEETINGBANK_SCORE},
}
MAIN_KIND = {"poetry": "score", "meetingbank": "criteria"}  # Table 4's number for each task


class JudgeError(Exception):
    """A one-line, user-facing judge problem (unreachable server, unknown model, unreadable file)."""


# ---------------------------------------------------------------- parsing the judge's answer
_NUMBER = r"[-+]?\d+(?:\.\d+)?"


def verdict_text(raw: str) -> str:
    """The judge's answer after any reasoning: text after the last </think>."""
    end = raw.rfind("</think>")
    return raw[end + len("</think>") :] if end >= 0 else raw


def _verdict_lines(raw: str, label: str) -> list[str]:
    """What follows "<label>:" on each line that starts with it ("Final score:", "**Overall score:**" too)."""
    text = verdict_text(raw).replace("*", "")  # **Score:** 80 in markdown
    return re.findall(rf"(?im)^[ \t#>-]*(?:final\s+)?{label}(?:\s+score)?\s*[:=][ \t]*(.*)$", text)


def parse_score(raw: str, label: str = "score", lo: float = 0, hi: float = 100) -> tuple[float | None, str]:
    """(score, "ok") from the last line "<label>: N" (N may be followed by "/100"), else (None, why).

    A bare number as the whole answer also counts. Two numbers on the verdict line, a number outside
    [lo, hi], another scale ("8/10") or no verdict at all (a refusal) are parse failures, never a 0.
    """
    raw = plain(raw)  # "Score: −15" is -15 (out of range), never 15; fullwidth "８０" is 80
    lines = _verdict_lines(raw, label)
    if not lines:
        bare = verdict_text(raw).replace("*", "")
        if not re.fullmatch(rf"\s*{_NUMBER}(?:\s*/\s*100)?\s*\.?\s*", bare):
            return None, "no score"
        lines = [bare.strip()]
    verdict = lines[-1]  # reasoning may name scores it then revises; the last verdict line decides
    scale = re.search(rf"({_NUMBER})\s*(?:/|out of)\s*({_NUMBER})", verdict)
    if scale and number(scale.group(2)) != 100:
        return None, f"other scale ({scale.group(0)})"
    numbers = re.findall(_NUMBER, re.sub(r"(?:/|out of)\s*100\b", "", verdict))
    if not numbers:
        return None, "no score"
    if len(numbers) > 1:
        return None, "two numbers"
    value = number(numbers[0])
    if not lo <= value <= hi:
        return None, "out of range"
    return value, "ok"


def parse_preference(raw: str) -> tuple[str | None, str]:
    """("A" | "B" | "tie", "ok") from the last "Preference: ..." line, else (None, why)."""
    lines = _verdict_lines(raw, "preference")
    if not lines:
        return None, "no preference"
    words = re.findall(r"\b(A|B|tie)\b", lines[-1], flags=re.IGNORECASE)
    if len({w.lower() for w in words}) != 1:
        return None, "no preference" if not words else "two preferences"
    return ("tie" if words[0].lower() == "tie" else words[0].upper()), "ok"


def parse_criteria(raw: str) -> tuple[dict, str]:
    """({criterion: score}, "ok") when all five criteria and the overall score parse; else the first failure."""
    scores, status = {}, "ok"
    for criterion in MEETINGBANK_CRITERIA:
        scores[criterion], why = parse_score(raw, label=criterion)
        if why != "ok" and status == "ok":
            status = f"{criterion}: {why}"
    return scores, status


# ---------------------------------------------------------------- statistics
# Student t 0.975 quantiles for 1..30 degrees of freedom; beyond, z + (z^3 + z) / (4 df) is within 1e-3
_T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


def mean_ci95(values) -> tuple[float | None, float | None, float | None]:
    """(mean, low, high): the mean with its 95% Student-t interval; None where undefined (n < 2)."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return None, None, None
    mean = sum(values) / n
    if n < 2:
        return mean, None, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    df, z = n - 1, 1.959964
    t = _T975[df - 1] if df <= 30 else z + (z**3 + z) / (4 * df)
    half = t * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _ranks(values) -> list[float]:
    """Ranks 1..n, tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x, y) -> float | None:
    """Spearman's rho: Pearson correlation of the ranks (ties averaged); None if either side is constant."""
    if len(x) != len(y):
        raise ValueError(f"spearman needs paired values, got {len(x)} and {len(y)}")
    if len(x) < 2:
        return None
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


# ---------------------------------------------------------------- the client
class Judge:
    """One judge model behind an OpenAI-compatible endpoint. `ask` retries connection errors, timeouts, 429 and
    5xx answers with exponential backoff (0.5 s doubling, at most 8 s). Each try ends `timeout` seconds after
    it began, its whole answer read: the client's own timeout is per read, so a server that sends a byte every
    few seconds would hold a request for ever."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        retries: int = 4,
        temperature: float = 0.6,
        max_tokens: int | None = None,
    ):
        from openai import OpenAI  # imported here so `import judge` stays cheap for eval.py's flag errors

        self.url, self.model, self.name = url, model, model
        self.temperature, self.max_tokens = temperature, max_tokens
        self.timeout, self.retries = timeout, retries
        # the retries are ask's own, so that each try, not only each read, has the deadline
        self.client = OpenAI(base_url=url, api_key=api_key or "EMPTY", timeout=timeout, max_retries=0)

    def check(self) -> None:
        """Fail in seconds, with one line, when the server is down or does not serve the model."""
        import openai

        try:
            served = [m.id for m in self.client.with_options(timeout=10.0, max_retries=1).models.list()]
        except (openai.APIConnectionError, openai.APITimeoutError) as err:
            raise JudgeError(
                f"cannot reach the judge server at {self.url} ({type(err).__name__}: {first_line(err)})"
            ) from None
        except openai.NotFoundError:
            return  # some OpenAI-compatible servers have no /models listing: the first request will tell
        except openai.APIError as err:
            raise JudgeError(f"judge server at {self.url} refused the model listing ({first_line(err)})") from None
        except (ValueError, TypeError, AttributeError) as err:  # an answer that is no JSON model list (a web page)
            raise JudgeError(
                f"the judge server at {self.url} answered GET /models with no OpenAI model list "
                f"({type(err).__name__}: {first_line(err)}); is --judge-url an OpenAI-compatible "
                "/v1 endpoint?"
            ) from None
        if self.model not in served:
            raise JudgeError(
                f"the judge server at {self.url} does not serve {self.model!r} "
                f"(it serves: {', '.join(served) or 'nothing'})"
            )

    def ask(self, messages: list[dict]) -> dict:
        """The judge's answer: {"raw", "finish_reason"} (+ "reasoning" when the server splits it off)."""
        import openai

        transient = (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError, TimeoutError)
        for attempt in range(self.retries + 1):
            try:
                return self._ask_once(messages)
            except transient:
                if attempt == self.retries:
                    raise
                time.sleep(min(8.0, 0.5 * 2**attempt))

    def _ask_once(self, messages: list[dict]) -> dict:
        """One try, in a daemon thread given `timeout` seconds in all: a trickling server's thread is left to
        finish or die with the process, never waited for."""
        outcome = {}

        def request():
            try:
                outcome["answer"] = self._answer(messages)
            except Exception as err:
                outcome["error"] = err

        worker = threading.Thread(target=request, daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            raise TimeoutError(f"the judge sent no whole answer within --judge-timeout {self.timeout:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["answer"]

    def _answer(self, messages: list[dict]) -> dict:
        response = self.client.chat.completions.create(
            model=self.model, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens
        )
        choice = response.choices[0]
        content = choice.message.content
        if isinstance(content, list):  # content parts, [{"type": "text", "text": ...}]: their text, in order
            content = "".join(str(part.get("text") or "") if isinstance(part, dict) else str(part) for part in content)
        answer = {
            "raw": content if isinstance(content, str) else "" if content is None else str(content),
            "finish_reason": choice.finish_reason,
        }
        reasoning = getattr(choice.message, "reasoning_content", None) or getattr(choice.message, "reasoning", None)
        if reasoning:
            answer["reasoning"] = reasoning
        return answer


# ---------------------------------------------------------------- building and reading judgments
def _user_request(record: dict) -> str:
    return next(m["content"] for m in reversed(record["prompt"]) if m["role"] == "user")


def _candidate_first(uid: str) -> bool:
    return int(hashlib.sha1(uid.encode()).hexdigest()[:8], 16) % 2 == 0  # departure 2


def judge_prompt(task: str, kind: str, record: dict) -> list[dict]:
    """The chat messages sent to the judge for one example (task, judgment kind)."""
    fields = {
        "request": _user_request(record),
        "candidate": final_answer(record["completion"]),
        "reference": record.get("reference", ""),
    }
    if kind == "pairwise":
        first = _candidate_first(record["uid"])
        fields["poem_a"], fields["poem_b"] = (
            (fields["candidate"], fields["reference"]) if first else (fields["reference"], fields["candidate"])
        )
    return [
        {"role": "system", "content": JUDGE_SYSTEM},
        {"role": "user", "content": RUBRICS[task][kind].format(**fields)},
    ]


def parse_judgment(task: str, kind: str, record: dict, raw: str) -> tuple[dict, str]:
    """(parsed fields, status) for one raw answer; status "ok" or the reason it did not parse."""
    if kind == "score":
        score, status = parse_score(raw)
        return {"score": score}, status
    if kind == "criteria":
        scores, status = parse_criteria(raw)
        return {**scores, "score": scores["overall"] if status == "ok" else None}, status
    preference, status = parse_preference(raw)
    candidate = "A" if _candidate_first(record["uid"]) else "B"
    outcome = (
        None if preference is None else "tie" if preference == "tie" else "win" if preference == candidate else "loss"
    )
    return {"preference": preference, "candidate": candidate, "outcome": outcome}, status


def load_previous(*paths: str) -> dict:
    """{uid: {judge: {kind: judgment}}} from earlier runs' eval files at `paths` (those that exist; {} if none). A
    later file's judgments win."""
    previous = {}
    for path in filter(os.path.exists, paths):
        try:
            with open(path) as f:
                records = json.load(f)["examples"]
            for r in records:
                for name, kinds in r.get("judge", {}).items():
                    previous.setdefault(r["uid"], {}).setdefault(name, {}).update(kinds)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise JudgeError(
                f"cannot resume from {path}: not an eval.py output ({first_line(err)}); "
                "move it away or pass another --out"
            ) from None
    return previous


def judge_result(
    result: dict,
    judges: list[Judge],
    path: str,
    *,
    save_to: str | None = None,
    concurrency: int = 8,
    save_every: float = 5.0,
    progress: bool = True,
) -> dict:
    """Judge every example of an eval result with every judge; keep judgments in `save_to` (default: `path`) as
    they arrive.

    Judgments already in `path` or `save_to` by the same judge for the same prompt (rubric, output and reference)
    are reused, not re-asked. eval.py saves to a file beside its --out, which it replaces only once the whole
    result is in: a failing judge never costs the earlier result there.
    Returns the judge summary (also stored as result["judge_summary"]). Raises JudgeError, after saving
    what was judged, when requests still fail after the client's retries.
    """
    task = result["summary"]["task"]
    if task not in RUBRICS:
        raise JudgeError(f"no judge rubric for task {task!r}: the judge scores {', '.join(RUBRICS)}")
    save_to = save_to or path
    previous = load_previous(*dict.fromkeys((path, save_to)))  # each file once
    jobs = []
    for record in result["examples"]:
        prompts = {kind: judge_prompt(task, kind, record) for kind in RUBRICS[task]}
        # every judge's earlier judgments stay (a second judge is often run later), if the prompt is unchanged
        record["judge"] = {
            name: {kind: j for kind, j in kinds.items() if j.get("prompt") == prompts.get(kind)}
            for name, kinds in previous.get(record["uid"], {}).items()
        }
        for judge in judges:
            kept = record["judge"].setdefault(judge.name, {})
            jobs += [(record, judge, kind) for kind in RUBRICS[task] if kind not in kept]
    skipped = len(result["examples"]) * len(judges) * len(RUBRICS[task]) - len(jobs)
    if progress and skipped:
        print(f"judge: {skipped} judgment(s) already in {path}, {len(jobs)} to ask")
    write_json(save_to, result, indent=1)

    stop = threading.Event()  # after one request fails for good, the queued ones are not sent

    def run(record, judge, kind):
        if stop.is_set():
            return None
        messages = judge_prompt(task, kind, record)
        try:
            answer = judge.ask(messages)
        except Exception as err:  # the client already retried; anything left ends the run, resumable
            import openai

            if isinstance(err, openai.BadRequestError):  # e.g. prompt over the judge's context: final
                return {
                    "prompt": messages,
                    "raw": None,
                    "parsed": parse_judgment(task, kind, record, "")[0],
                    "status": f"rejected: {first_line(err)}",
                }
            stop.set()
            raise
        parsed, status = parse_judgment(task, kind, record, answer["raw"])
        return {"prompt": messages, **answer, "parsed": parsed, "status": status}

    failures, answered, last_save = [], 0, time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = {pool.submit(run, *job): job for job in jobs}
        try:
            for future in as_completed(futures):
                record, judge, kind = futures[future]
                try:
                    judgment = future.result()
                except Exception as err:
                    failures.append(err)
                    continue
                if judgment is not None:
                    record["judge"][judge.name][kind] = judgment
                    answered += 1
                if time.monotonic() - last_save > save_every:
                    write_json(save_to, result, indent=1)
                    last_save = time.monotonic()
        finally:  # Ctrl-C or a failure: keep every judgment that came back
            stop.set()
            result["judge_summary"] = summarize(result, judges)
            write_json(save_to, result, indent=1)
    if failures:
        import openai

        # a server or network failure may pass; an answer this code cannot read comes back the same on a rerun
        transient = all(isinstance(err, (openai.APIError, OSError)) for err in failures)
        advice = (
            "rerun the same command to finish"
            if transient
            else "rerunning asks again and fails the same way: "
            "the judge's answers are not what judge.py reads (see the error)"
        )
        raise JudgeError(
            f"{len(failures)} judge request(s) failed after retries (last: {type(failures[-1]).__name__}: "
            f"{first_line(failures[-1])}); the {answered} answered are saved in {save_to}: {advice}"
        )
    return result["judge_summary"]


def scores_of(result: dict, judge_name: str) -> dict:
    """{uid: main score} for the examples whose main judgment parsed."""
    kind = MAIN_KIND[result["summary"]["task"]]
    return {
        r["uid"]: j["parsed"]["score"]
        for r in result["examples"]
        if (j := r.get("judge", {}).get(judge_name, {}).get(kind)) and j["status"] == "ok"
    }


def summarize(result: dict, judges: list[Judge]) -> dict:
    """Per judge: mean main score with its 95% interval, parse failures, win rate (poetry), criteria
    means (meetingbank); for each pair of judges, the Spearman correlation of their per-example scores."""
    task = result["summary"]["task"]
    summary = {"task": task, "judges": {}}
    for judge in judges:
        judgments = [r["judge"][judge.name] for r in result["examples"] if judge.name in r.get("judge", {})]
        scores = list(scores_of(result, judge.name).values())
        mean, low, high = mean_ci95(scores)
        row = {
            "url": judge.url,
            "model": judge.model,
            "score_mean": mean,
            "score_ci95": [low, high],
            "n_scored": len(scores),
        }
        for kind in RUBRICS[task]:
            asked = [j[kind] for j in judgments if kind in j]
            rejected = [j for j in asked if j["status"].startswith("rejected")]
            failed = [j for j in asked if j["status"] != "ok" and j not in rejected]
            row[f"{kind}/asked"], row[f"{kind}/rejected"] = len(asked), len(rejected)
            row[f"{kind}/parse_failures"], answers = len(failed), len(asked) - len(rejected)
            row[f"{kind}/parse_failure_rate"] = len(failed) / answers if answers else None
        if "pairwise" in RUBRICS[task]:
            outcomes = [
                j["pairwise"]["parsed"]["outcome"]
                for j in judgments
                if "pairwise" in j and j["pairwise"]["status"] == "ok"
            ]
            wins = sum(o == "win" for o in outcomes) + 0.5 * sum(o == "tie" for o in outcomes)
            row["win_rate"] = wins / len(outcomes) if outcomes else None  # ties count half
            row["n_pairwise"] = len(outcomes)
        if task == "meetingbank":
            ok = [j["criteria"]["parsed"] for j in judgments if "criteria" in j and j["criteria"]["status"] == "ok"]
            for criterion in MEETINGBANK_CRITERIA[:-1]:
                row[f"{criterion}_mean"] = mean_ci95([p[criterion] for p in ok])[0]
        summary["judges"][judge.name] = row
    for i, first in enumerate(judges):
        for second in judges[i + 1 :]:
            a, b = scores_of(result, first.name), scores_of(result, second.name)
            both = sorted(set(a) & set(b))
            summary[f"spearman/{first.name} vs {second.name}"] = spearman([a[u] for u in both], [b[u] for u in both])
            summary[f"spearman_n/{first.name} vs {second.name}"] = len(both)
    return summary


def compare_methods(results: dict[str, dict], judges: list[Judge]) -> dict:
    """Table B.4's cross-judge check: each method's mean score under each judge, and for each pair of
    judges the Spearman correlation of the two method rankings. `results`: {method label: eval result}."""
    means = {
        label: {j.name: result["judge_summary"]["judges"][j.name]["score_mean"] for j in judges}
        for label, result in results.items()
    }
    table = {"methods": means}
    for i, first in enumerate(judges):
        for second in judges[i + 1 :]:
            rows = [m for m in means.values() if m[first.name] is not None and m[second.name] is not None]
            table[f"spearman/{first.name} vs {second.name}"] = spearman(
                [m[first.name] for m in rows], [m[second.name] for m in rows]
            )
    return table


# ---------------------------------------------------------------- flags shared with eval.py
def add_judge_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LLM judge (poetry, meetingbank)")
    group.add_argument(
        "--judge-url",
        action="append",
        default=[],
        help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1; twice for two servers",
    )
    group.add_argument(
        "--judge-model",
        action="append",
        default=[],
        help="judge model name as the server knows it; twice for a second judge",
    )
    group.add_argument("--judge-key-env", default=None, help="environment variable holding the API key")
    group.add_argument("--judge-concurrency", type=int, default=8, help="requests in flight at most")
    group.add_argument("--judge-max-tokens", type=int, default=None, help="answer length cap (default: server's)")
    group.add_argument(
        "--judge-temperature",
        type=number,
        default=0.6,
        help="0.6: Qwen3 thinking models' recommended setting (greedy decoding can loop)",
    )
    group.add_argument("--judge-timeout", type=number, default=600.0, help="seconds per request before a retry")
    group.add_argument("--judge-retries", type=int, default=4, help="retries per request, with backoff")


def judge_args_error(args) -> str | None:
    """The one-line flag error, or None; eval.py's args also carry the --task to judge."""
    urls, models = args.judge_url, args.judge_model
    if not urls and not models:
        return None
    if not urls or not models:
        return "--judge-url and --judge-model go together"
    if len(urls) > 1 and len(models) > 1 and len(urls) != len(models):
        return "give one --judge-url per --judge-model, or one URL for all models, or one model for all URLs"
    if args.judge_key_env and not os.environ.get(args.judge_key_env):
        return f"--judge-key-env: environment variable {args.judge_key_env} is not set"
    if args.judge_concurrency < 1 or args.judge_retries < 0 or not args.judge_timeout > 0:
        return "--judge-concurrency must be >= 1, --judge-retries >= 0 and --judge-timeout > 0"
    if args.judge_max_tokens is not None and args.judge_max_tokens < 1:
        return "--judge-max-tokens must be >= 1"
    if getattr(args, "task", None) not in (None, *RUBRICS):
        return f"the LLM judge scores {', '.join(RUBRICS)}, not {args.task}"
    return None


def connect_judges(args) -> list[Judge]:
    """The judges the flags name, each checked against its server (JudgeError when unreachable)."""
    urls, models = args.judge_url, args.judge_model
    count = max(len(urls), len(models))
    pairs = [(urls[min(i, len(urls) - 1)], models[min(i, len(models) - 1)]) for i in range(count)]
    key = os.environ.get(args.judge_key_env) if args.judge_key_env else None
    judges = [
        Judge(
            url,
            model,
            api_key=key,
            timeout=args.judge_timeout,
            retries=args.judge_retries,
            temperature=args.judge_temperature,
            max_tokens=args.judge_max_tokens,
        )
        for url, model in pairs
    ]
    if len({j.model for j in judges}) < len(judges):  # same model on two servers: tell them apart
        for judge in judges:
            judge.name = f"{judge.model}@{judge.url}"
    for judge in judges:
        judge.check()
    return judges


def format_judge_summary(summary: dict) -> str:
    lines = []
    for name, row in summary["judges"].items():
        mean, (low, high) = row["score_mean"], row["score_ci95"]
        shown = "n/a" if mean is None else f"{mean:.1f}" + ("" if low is None else f" [{low:.1f}, {high:.1f}]")
        lines.append(f"judge {name}: score {shown} (95% CI, n={row['n_scored']})")
        for key, value in row.items():
            if key.endswith(("parse_failures", "rejected", "win_rate", "_mean")) and key != "score_mean":
                lines.append(f"  {key:<28}{'n/a' if value is None else f'{value:.3g}'}")
    lines += [
        f"{key:<40}{'n/a' if v is None else f'{v:.3f}'}" for key, v in summary.items() if key.startswith("spearman/")
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI: judge existing eval files
def main(argv=None) -> dict:
    parser = OneLineParser("judge.py", description="Judge eval.py outputs of poetry/meetingbank with an LLM judge.")
    parser.add_argument("outputs", nargs="+", help="eval.py JSON files; several = several methods to compare")
    parser.add_argument("--labels", nargs="*", default=None, help="method names for the outputs (default: paths)")
    parser.add_argument("--out", default=None, help="write the cross-method comparison here (JSON)")
    add_judge_args(parser)
    args = parser.parse_args(argv)
    error = judge_args_error(args) or (None if args.judge_url else "--judge-url and --judge-model are required")
    if args.labels and len(args.labels) != len(args.outputs):
        error = "--labels needs one name per output file"
    if error:
        parser.error(error)
    try:
        results = {}
        for path in args.outputs:
            try:
                with open(path) as f:
                    results[path] = json.load(f)
                results[path]["summary"]["task"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise JudgeError(f"cannot read {path} as an eval.py output ({first_line(err)})") from None
        judges = connect_judges(args)
        for path, result in results.items():
            print(f"== {path}")
            print(format_judge_summary(judge_result(result, judges, path, concurrency=args.judge_concurrency)))
    except JudgeError as err:
        print(f"judge.py: error: {err}", file=sys.stderr)
        sys.exit(1)
    labels = dict(zip(args.outputs, args.labels or args.outputs))
    comparison = compare_methods({labels[p]: r for p, r in results.items()}, judges)
    if len(results) > 1:
        print(json.dumps(comparison, indent=1))
    if args.out:
        write_json(args.out, comparison, indent=1)
        print(f"wrote {args.out}")
    return comparison


if __name__ == "__main__":
    main()
