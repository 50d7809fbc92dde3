"""train.py's logs on rank 0 (metrics, completions, evals) and each phase's time and memory.

python train.py --steps 5 && head -1 runs/arith-softmax-s0/metrics.jsonl
"""

import contextlib
import json
import os
import time
from dataclasses import asdict

import torch

from plumbing.files import CheckpointError, append_jsonl, write_json, write_jsonl
from plumbing.parallel import all_reduce_sum, gather_objects, per_rank
from speed.allocator import release_freed_memory


def param_counts(model) -> tuple[int, int]:
    """(body, head) parameter counts."""
    n_head = model.get_output_embeddings().weight.numel()
    n_tied = 0 if model.config.tie_word_embeddings else n_head
    return sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel() - n_tied, n_head


def read_log(path: str, note: bool = True) -> list[dict]:
    """The one reader of a run's own JSON Lines logs ([] when absent): CheckpointError for a line that is not an object
    with an integer "step"; a cut-short last line (a run stopped mid-write) is left out, with a `note`."""
    rows = []
    with open(path, "rb") if os.path.exists(path) else contextlib.nullcontext([]) as f:
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                if note:
                    print(f"note: line {number} of {path} was cut short (a run stopped mid-write): left out")
                break
            try:
                rows.append(json.loads(line))
            except ValueError:  # also bytes that are not UTF-8
                rows.append(None)
            if not isinstance(rows[-1], dict) or type(rows[-1].get("step")) is not int:
                raise CheckpointError(
                    f"line {number} of {path} is damaged (not a JSON object with an integer step): "
                    "mend or delete that line"
                )
    return rows


def keep_steps(path: str, step: int):
    if os.path.exists(path):
        write_jsonl(path, [row for row in read_log(path) if row["step"] <= step])


def user_text(prompt) -> str:
    """The last user message of a chat prompt."""
    if not isinstance(prompt, list):
        return str(prompt)
    return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")


class SampleLog:
    """Up to `n` samples a step in completions.jsonl; evaluations in eval-STEP.jsonl. n = 0 writes neither."""

    def __init__(self, out_dir: str, start_step: int, n: int, master: bool):
        self.out_dir, self.n, self.master = out_dir, n, master
        self.path = os.path.join(out_dir, "completions.jsonl")
        if master:  # a resumed run drops what was logged after its checkpoint (lock_run_folder made the folder)
            keep_steps(self.path, start_step)
            for name in os.listdir(out_dir):
                if name.startswith("eval-") and name[5:-6].isdigit() and int(name[5:-6]) > start_step:
                    os.remove(os.path.join(out_dir, name))

    def write(self, step: int, task, batch, adv, rank: int):
        """Step `step`'s first n samples; scores and adv: gathered (G, M)."""
        if not self.n:
            return
        rollout, groups = batch.scores, batch.groups
        rows, first = [], rank * len(groups)  # this rank's rows of the gathered tensors start at `first`
        for g, (example, group) in enumerate(zip(batch.examples, groups)):
            for k, c in enumerate(group[: self.n - len(rows)]):
                rows.append(
                    {
                        "step": step,
                        "uid": example.uid,
                        "prompt": user_text(example.prompt),
                        "completion": c.text,
                        "reward": rollout["rewards"][first + g, k].item(),
                        "passed": bool(rollout["passed"][first + g, k]) if task.has_verifier else None,
                        "advantage": adv[first + g, k].item(),
                        "length": len(c.token_ids),
                        "finish_reason": c.finish_reason,
                    }
                )
        if len(groups) * len(groups[0]) < self.n:  # rank 0's rows fall short
            rows = gather_objects(rows)[: self.n]
        if self.master:
            append_jsonl(self.path, rows)

    def write_eval(self, step: int, *sets: list[dict]):
        """One evaluation's records, all ranks', set by set."""
        if not self.n:
            return
        rows = [
            {"step": step, **{k: v for k, v in r.items() if k != "reference"}, "prompt": user_text(r["prompt"])}
            for records in sets
            for r in gather_objects(records)
        ]
        if self.master:
            write_jsonl(os.path.join(self.out_dir, f"eval-{step:06d}.jsonl"), rows)


class MetricsLog:
    """metrics.jsonl, and W&B with --wandb, on rank 0."""

    def __init__(self, out_dir: str, start_step: int, args, master: bool):
        self.path, self.master, self.wandb = os.path.join(out_dir, "metrics.jsonl"), master, None
        if not master:
            return
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
            append_jsonl(self.path, [metrics])
            if self.wandb:
                self.wandb.log(metrics, step=metrics["step"])

    def finish(self):
        if self.wandb:
            self.wandb.finish()


class Phases:
    """`with phase(NAME):` logs time/NAME and, on CUDA, mem/peak_gb/NAME less what the sampler holds."""

    def __init__(self, device):
        self.device, self.cuda, self.times = device, device.type == "cuda", {}
        self.engine = self.held = 0
        self.memory = {"mem/device": float(device.index or 0)} if self.cuda else {}

    def build(self, make_sampler, *args, **kwargs):
        """make_sampler(...), recording its memory and device."""
        before = torch.cuda.memory_allocated(self.device) if self.cuda else 0
        sampler = make_sampler(*args, **kwargs)
        if self.cuda:
            self.engine = self.held = torch.cuda.memory_allocated(self.device) - before
            where = sampler.device()
            self.memory.update(
                {
                    "mem/engine_gb": self.engine / 1e9,
                    "engine/device": float(where.index if where.type == "cuda" else -1),
                }
            )
        return sampler

    def sleep(self, sampler):
        """sampler.sleep(), recording memory on CUDA, releasing freed pages on CPU."""
        if not self.cuda:
            sampler.sleep()
            release_freed_memory()
            return
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        sampler.sleep()
        self.held = max(0, self.engine - (allocated - torch.cuda.memory_allocated(self.device)))
        self.memory.update(
            {
                "mem/used_before_sleep_gb": (total - free) / 1e9,
                "mem/used_after_sleep_gb": (total - torch.cuda.mem_get_info(self.device)[0]) / 1e9,
            }
        )

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        yield
        self.times[f"time/{name}"] = time.perf_counter() - start
        if self.cuda:
            engine = self.held if name in ("reward", "train") else self.engine  # awake in rollout, sync and eval
            self.memory[f"mem/peak_gb/{name}"] = (torch.cuda.max_memory_allocated(self.device) - engine) / 1e9

    def seconds(self) -> float:
        return sum(self.times.values())

    def metrics(self) -> dict:
        """This step's time/NAME and each rank's mem/... (a collective on CUDA)."""
        times, self.times = self.times, {}
        return {**times, **(per_rank(self.memory) if self.cuda else {})}


def read_evals(out_dir: str) -> dict:
    """eval.json of a resumed run, or {}."""
    path = os.path.join(out_dir, "eval.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{path} is damaged ({type(err).__name__}): delete it to resume without the "
            "held-out score from before training"
        ) from None


def report_eval(evals: dict, when: str, scores: dict, out_dir: str, task, n: int, master: bool):
    """`scores` into eval.json as `when` ("before", "after"), printed on rank 0."""
    if "eval/score" in scores:
        evals[when] = scores["eval/score"]
    others = {key: value for key, value in scores.items() if key != "eval/score"}
    if others:
        evals.setdefault("sets", {})[when] = others
    if not master:
        return
    write_json(os.path.join(out_dir, "eval.json"), evals)
    for key, value in others.items():
        print(f"held-out {key.removeprefix('eval/')}: {value:.3f}")
    name = "greedy pass@1" if task.has_verifier else "greedy similarity reward"
    if "after" in evals:
        print(
            f"held-out {name}: before {evals.get('before', float('nan')):.3f}, after {evals['after']:.3f} ({n} prompts)"
        )
    elif "before" in evals:
        print(f"held-out {name} before training: {evals['before']:.3f} ({n} prompts)")


def step_metrics(step: int, has_verifier: bool, batch, adv, train_metrics, seconds, n_params, n_forwards, device):
    """One step's flat metrics, identical on every rank; `adv`: (G, M)."""
    rollout, groups = batch.scores, batch.groups
    n_body, n_head = n_params
    rewards, lengths = rollout["rewards"], rollout["lengths"]
    prompt = sum(len(p) * len(g) for p, g in zip(batch.prompts, groups))
    prompt_tokens = all_reduce_sum([prompt], device)[0]
    completion_tokens = lengths.sum().item()  # the lengths are gathered: every rank's
    flops = n_forwards * (2 * n_body * (prompt_tokens + completion_tokens) + 2 * n_head * completion_tokens)
    metrics = {"step": step + 1, "reward/mean": rewards.mean().item(), "reward/std": rewards.std(correction=0).item()}
    if has_verifier:
        metrics["reward/pass_rate"] = rollout["passed"].mean().item()
    for term, values in rollout["terms"].items():
        metrics[f"reward/{term}"] = values.mean().item()
    return metrics | {
        "reward/errors": rollout["errors"],
        "adv/zero_group_frac": (adv.abs().amax(-1) < 1e-6).float().mean().item(),
        "response/len_mean": lengths.mean().item(),
        "response/len_max": lengths.max().item(),
        "response/trunc_frac": rollout["cut"].mean().item(),
        **train_metrics,
        "time/step": seconds,
        "perf/tokens_per_s": completion_tokens / seconds,
        "perf/tflops": flops / seconds / 1e12,
    }
