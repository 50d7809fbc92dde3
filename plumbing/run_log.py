"""Where train.py's numbers go: metrics.jsonl and Weights & Biases on rank 0, and eval.json with the held-out
score before and after training (step_metrics makes the per-step dict), and the two kinds of metric a loss returns
(Share, TokenMean), which say how train.py reduces them over micro-batches and ranks. The curves of metrics.jsonl are
train.py's to draw (tools/figures.py): plumbing/ sits below tools/ and imports nothing from it.

    python train.py --steps 5 && head -1 runs/arith-softmax-s0/metrics.jsonl
"""

import json
import math
import os
from dataclasses import asdict

import torch

from plumbing.files import append_lines, write_json, write_lines
from plumbing.parallel import gather_objects, per_rank


class Share(float):
    """A metric reduced like the loss: this micro-batch's share of the minibatch's value (train.py sums the shares
    of a minibatch and averages over optimizer steps)."""


class TokenMean(float):
    """A metric that is a mean over this micro-batch's loss tokens (train.py weighs it by their number)."""

    @classmethod
    def of(cls, values: torch.Tensor, mask: torch.Tensor) -> "TokenMean":
        """The mean of per-token values (B, T) (a bool counts 1 where true) over the tokens of a (B, T) 0/1 mask."""
        return cls(((values.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)).item())


def model_flops_per_token(model) -> tuple[int, int]:
    """(body, head) parameter counts: 2 FLOPs per parameter and token forward; the head only where logits are."""
    n_head = model.get_output_embeddings().weight.numel()
    n_body = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel() - (
        0 if model.config.tie_word_embeddings else n_head)
    return n_body, n_head


def _step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a line a kill cut short while it was appended
        return math.inf


def keep_steps(path: str, last_step: int):
    """Drop the lines of the JSON Lines file `path` (if any) logged for steps after `last_step`, and a torn last
    line: on resume those steps run again, and their rows must not appear twice. Rewritten whole (plumbing/files)."""
    if os.path.exists(path):
        write_lines(path, [line for line in open(path) if _step(line) <= last_step])


def write_jsonl(path: str, rows: list[dict], mode: str = "w"):
    """Rows as JSON Lines: appended (mode "a"), or a new file written whole (plumbing/files), never half there."""
    lines = [json.dumps(row) + "\n" for row in rows]
    if mode == "w":
        write_lines(path, lines)
    else:
        append_lines(path, lines)


def user_text(prompt) -> str:
    """The last user message of a chat prompt: what the sample answers, without the system message."""
    return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "") if isinstance(
        prompt, list) else str(prompt)


class SampleLog:
    """Rollouts a person can read: up to `n` samples of each step, gathered from all ranks (rank-major: rank 0's
    first, whole groups of M when n allows) and appended by rank 0 to completions.jsonl; every evaluation's greedy
    generations in eval-STEP.jsonl. n = 0 writes neither. On resume, the rows of steps that run again go."""

    def __init__(self, out_dir: str, start_step: int, n: int, master: bool):
        self.out_dir, self.n, self.master = out_dir, n, master
        self.path = os.path.join(out_dir, "completions.jsonl")
        if master and os.path.isdir(out_dir):  # a resume: what was logged after its checkpoint runs again
            keep_steps(self.path, start_step)
            for name in os.listdir(out_dir):
                if name.startswith("eval-") and name[5:-6].isdigit() and int(name[5:-6]) > start_step:
                    os.remove(os.path.join(out_dir, name))

    def write(self, step: int, task, examples, groups, rollout: dict, adv, rank: int):
        """Step `step`'s first n samples. rollout's (G, M) tensors and adv (G, M) are gathered, rank-major."""
        if not self.n:
            return
        rows, first = [], rank * len(groups)  # this rank's first group in the gathered tensors
        for g, (example, group) in enumerate(zip(examples, groups)):
            for k, c in enumerate(group[:self.n - len(rows)]):
                rows.append({"step": step, "uid": example.uid, "prompt": user_text(example.prompt),
                             "completion": c.text, "reward": rollout["rewards"][first + g, k].item(),
                             "passed": bool(rollout["passed"][first + g, k]) if task.has_verifier else None,
                             "advantage": adv[first + g, k].item(), "length": len(c.token_ids),
                             "finish_reason": c.finish_reason})
        if len(groups) * len(groups[0]) < self.n:  # rank 0's own rows fall short (the same test on every rank)
            rows = gather_objects(rows)[:self.n]
        if self.master:
            write_jsonl(self.path, rows, mode="a")

    def write_eval(self, step: int, *sets: list[dict]):
        """One evaluation's records (eval.evaluate's, this rank's share of each held-out set), all ranks', set by
        set, in eval-STEP.jsonl; with --eval-samples each record keeps its K samples and their rewards."""
        if not self.n:
            return
        rows = [{"step": step, **{k: v for k, v in r.items() if k != "reference"}, "prompt": user_text(r["prompt"])}
                for records in sets for r in gather_objects(records)]
        if self.master:
            write_jsonl(os.path.join(self.out_dir, f"eval-{step:06d}.jsonl"), rows)


class MetricsLog:
    """metrics.jsonl, and Weights & Biases with --wandb, written by rank 0. On resume, lines logged after the
    checkpoint are dropped: they belong to steps that run again."""

    def __init__(self, out_dir: str, start_step: int, args, master: bool):
        self.path, self.master, self.wandb = os.path.join(out_dir, "metrics.jsonl"), master, None
        if not master:
            return
        os.makedirs(out_dir, exist_ok=True)
        keep_steps(self.path, start_step)
        if args.wandb:
            try:
                import wandb
            except ImportError:
                print("note: wandb is not installed; logging to metrics.jsonl only")
            else:
                self.wandb = wandb
                wandb.init(project="softmax-grpo", name=os.path.basename(out_dir), config=asdict(args))

    def write(self, metrics: dict):
        if self.master:
            append_lines(self.path, [json.dumps(metrics) + "\n"])
            if self.wandb:
                self.wandb.log(metrics, step=metrics["step"])

    def finish(self):
        """Ends the W&B run. The curves of metrics.jsonl (self.path) are train.py's to draw: tools/figures.py."""
        if self.wandb:
            self.wandb.finish()


class PhaseMemory:
    """What one rank's GPU memory did in a step, as the rank measured it (CUDA only; on CPU nothing): the trainer's
    peak in each phase (the torch allocator's, reset as the phase starts, less what the engine holds through it),
    the engine's transient peak in each phase apart from it, the device memory in use just before and just after
    the sampler sleeps, whose difference is the engine's share, and two devices: the trainer's (`mem/device`,
    LOCAL_RANK's) and the engine's as the engine reports it (`engine/device`), which is where two ranks' engines
    could collide. scripts/gpu_check.sh checks them.

    What the engine holds through torch's allocator: all it allocated while built, except while asleep, where a
    vLLM engine still holds it (its sleep unmaps the memory behind torch's back) and the HF sampler holds what its
    sleep left allocated (its freed weights leave torch's count). The train phase is the one spent wholly asleep.

    The engine's transient buffers (a forward's activations, the sampler's logits, a reload's casts: torch's
    allocator, outside vLLM's pool) are what its calls (generate, update_weights, weight_checksums) allocate
    above what was allocated as each began: `mem/engine_transient_gb/PHASE`. The trainer's peak is taken outside
    those calls, so it holds only what tools/memory_plan.py plans for the trainer. One exception: update_weights
    reads the trainer's full_weights as it goes, so each gathered parameter counts as the engine's."""

    ENGINE_CALLS = ("generate", "update_weights", "weight_checksums")

    def __init__(self, device):
        self.device, self.on, self.engine, self.asleep = device, device.type == "cuda", 0, 0
        self.trainer_peak, self.transient = 0, 0  # this phase's, in bytes: outside, and inside the engine's calls
        self.in_engine = False
        self.values = {"mem/device": float(device.index or 0)} if self.on else {}

    def build(self, make_sampler, *args, **kwargs):
        """make_sampler(...), counting what the engine allocates through torch's allocator (vLLM's memory pool);
        on CUDA its calls are then counted apart from the trainer's (`_engine_call`)."""
        before = torch.cuda.memory_allocated(self.device) if self.on else 0
        sampler = make_sampler(*args, **kwargs)
        if self.on:
            self.engine = self.asleep = torch.cuda.memory_allocated(self.device) - before
            engine_device = sampler.device()
            self.values.update({"mem/engine_gb": self.engine / 1e9, "engine/device": float(
                engine_device.index if engine_device.type == "cuda" else -1)})  # -1: not on a GPU at all
            for name in self.ENGINE_CALLS:
                if hasattr(sampler, name):
                    setattr(sampler, name, self._engine_call(getattr(sampler, name)))
        return sampler

    def _engine_call(self, call):
        """`call`, with the peak before it kept as the trainer's and the peak inside it as the engine's transient."""
        def counted(*args, **kwargs):
            if self.in_engine:  # one engine call inside another: the outer one counts both
                return call(*args, **kwargs)
            self.in_engine = True
            self.trainer_peak = max(self.trainer_peak, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
            try:
                return call(*args, **kwargs)
            finally:
                self.transient = max(self.transient, torch.cuda.max_memory_allocated(self.device) - start)
                torch.cuda.reset_peak_memory_stats(self.device)  # the trainer's count resumes from here
                self.in_engine = False
        return counted

    def _used_gb(self) -> float:
        free, total = torch.cuda.mem_get_info(self.device)
        return (total - free) / 1e9

    def start(self):
        if self.on:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.trainer_peak = self.transient = 0

    def sleep(self, sampler) -> int:
        """sampler.sleep(), with the device's used memory around it."""
        before = self._used_gb() if self.on else 0.0
        allocated = torch.cuda.memory_allocated(self.device) if self.on else 0
        freed = sampler.sleep()
        if self.on:
            self.values.update({"mem/used_before_sleep_gb": before, "mem/used_after_sleep_gb": self._used_gb()})
            self.asleep = max(0, self.engine - (allocated - torch.cuda.memory_allocated(self.device)))
        return freed

    def end(self, phase: str):
        """The phase's peaks, and fresh counts for the next one."""
        if self.on:
            engine = self.asleep if phase == "train" else self.engine  # rollout and sync peak with it awake
            peak = max(self.trainer_peak, torch.cuda.max_memory_allocated(self.device))
            self.values[f"mem/peak_gb/{phase}"] = (peak - engine) / 1e9
            self.values[f"mem/engine_transient_gb/{phase}"] = self.transient / 1e9
            torch.cuda.reset_peak_memory_stats(self.device)
            self.trainer_peak = self.transient = 0

    def metrics(self) -> dict:
        return per_rank(self.values, self.device) if self.on else {}


def read_evals(out_dir: str) -> dict:
    """eval.json of a run being resumed ({} when it has none); a damaged one is a one-line CheckpointError."""
    from plumbing.checkpoint import CheckpointError

    path = os.path.join(out_dir, "eval.json")
    try:
        with open(path) as f:
            evals = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is damaged ({type(err).__name__}): delete it to resume without the "
                              "held-out score from before training") from None
    if not isinstance(evals, dict):
        raise CheckpointError(f"{path} is damaged (not a JSON object): delete it to resume without it")
    return evals


def eval_metrics(metrics: dict) -> dict:
    """The held-out scores among one step's metrics ({} when that step did not evaluate)."""
    return {key: value for key, value in metrics.items() if key.startswith("eval/")}


def add_eval(evals: dict, when: str, scores: dict):
    """train.evaluate_held_out's `scores` into eval.json's dict as `when` ("before", "after"): the greedy score of
    the task's own set as evals[when], the sampled and --eval-tasks scores (when any) under evals["sets"][when]."""
    if "eval/score" in scores:
        evals[when] = scores["eval/score"]
    if others := {key: value for key, value in scores.items() if key != "eval/score"}:
        evals.setdefault("sets", {})[when] = others


def report_eval(evals: dict, out_dir: str, task, n: int, master: bool):
    """eval.json and one line, on rank 0; written before training too, so a resumed run still reports it."""
    if not master:
        return
    name = "greedy pass@1" if task.has_verifier else "greedy similarity reward"
    path = os.path.join(out_dir, "eval.json")
    write_json(path, evals)  # whole or not at all: a full disk never leaves half a file
    for key, value in evals.get("sets", {}).get("after" if "after" in evals.get("sets", {}) else "before",
                                                {}).items():
        print(f"held-out {key.removeprefix('eval/')}: {value:.3f}")  # the sampled and --eval-tasks scores
    if "before" not in evals and "after" not in evals:  # only --eval-tasks' sets: no greedy score of the task's
        return
    if "after" in evals:
        print(f"held-out {name}: before {evals.get('before', float('nan')):.3f}, after {evals['after']:.3f} "
              f"({n} prompts)")
    else:
        print(f"held-out {name} before training: {evals['before']:.3f} ({n} prompts)")


def step_metrics(step: int, has_verifier: bool, rollout, adv, train_metrics, times, tokens, n_params, n_forwards):
    """One step's flat dict, identical on every rank: `rollout` holds the gathered (G, M) rewards, passed, lengths,
    cut and reward terms (train.py: score), `adv` the (G, M) advantages."""
    prompt_tokens, completion_tokens = tokens
    n_body, n_head = n_params
    flops = n_forwards * (2 * n_body * (prompt_tokens + completion_tokens) + 2 * n_head * completion_tokens)
    rewards, lengths = rollout["rewards"], rollout["lengths"]
    return {"step": step + 1, "reward/mean": rewards.mean().item(), "reward/std": rewards.std(correction=0).item(),
            **({"reward/pass_rate": rollout["passed"].mean().item()} if has_verifier else {}),
            **{f"reward/{term}": values.mean().item() for term, values in rollout["terms"].items()},
            "reward/errors": rollout["errors"],  # exceptions the rewards caught and scored 0 (rewards.py)
            "adv/zero_group_frac": (adv.abs().amax(-1) < 1e-6).float().mean().item(),
            "response/len_mean": lengths.mean().item(), "response/len_max": lengths.max().item(),
            "response/trunc_frac": rollout["cut"].mean().item(), **train_metrics,
            **{f"time/{name}": seconds for name, seconds in times.items()},
            "perf/tokens_per_s": completion_tokens / times["step"],
            "perf/tflops": flops / times["step"] / 1e12}  # model FLOPs estimate, all devices
