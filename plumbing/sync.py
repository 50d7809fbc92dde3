"""The sampler/trainer agreement check's verdict: a sampler that stopped receiving the weights stops the run.

rollout.sync_check samples a short seeded probe and scores it with the trainer (a `SyncProbe`); `check_sync`
compares the two on every rank, after every weight sync, and raises SyncError on all ranks together.

    python -m pytest tests/test_train.py -k sync
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from plumbing.parallel import all_reduce_sum, per_rank


class SyncError(RuntimeError):
    """The sampler no longer computes the trainer's policy: the run stops rather than train on stale samples."""


@dataclass
class SyncProbe:
    """The sampler's and the trainer's log-probs of the same short, seeded probe completions."""

    token_ids: list[list[int]]  # the probe completions
    sampler_logp: torch.Tensor  # (B, K) as the sampler reported them
    trainer_logp: torch.Tensor  # (B, K) recomputed by the trainer
    mask: torch.Tensor  # (B, K) 1 on completion tokens

    @property
    def diff(self) -> float:
        """Mean |sampler log-prob - trainer log-prob| over the probe's tokens (0 when in sync). The mean, not
        the largest: in bfloat16 a rare token's log-prob alone can differ by half a nat between two correct
        implementations, while a sampler on other weights moves every token."""
        return ((self.sampler_logp - self.trainer_logp).abs() * self.mask).sum().item() / self.mask.sum().item()

    @property
    def max_diff(self) -> float:
        """Largest |sampler log-prob - trainer log-prob| over the probe's tokens."""
        return ((self.sampler_logp - self.trainer_logp).abs() * self.mask).max().item()

    def trainer_moved_alone(self, before: "SyncProbe") -> float:
        """How far the trainer's log-probs moved since `before` while the sampler's stayed bit-identical:
        the sampler never received the update. 0 when the sampler moved too (or the probe changed)."""
        if before.token_ids != self.token_ids or not torch.equal(before.sampler_logp, self.sampler_logp):
            return 0.0
        return ((self.trainer_logp - before.trainer_logp).abs() * self.mask).max().item()



def check_sync(probe, before, step: int, tolerance: float, device) -> dict:
    """Stop the run (SyncError on every rank) unless every rank's sampler now computes its trainer's log-probs.

    Two failures: the probe log-probs disagree by more than `tolerance`, or the trainer's moved since the
    last check while the sampler's stayed bit-identical (an update that never arrived, too small to exceed
    the tolerance on its own). Returns the sync metrics, one difference per rank.
    """
    moved_alone = probe.trainer_moved_alone(before) if before is not None else 0.0
    worst_diff, worst_moved = all_reduce_sum([probe.diff, moved_alone], device, op=dist.ReduceOp.MAX)
    if worst_diff > tolerance:
        raise SyncError(f"step {step}: the sampler's log-probs differ from the trainer's by {worst_diff:.3g} nats "
                        f"> --sync-tolerance {tolerance:g}; the weight sync is broken")
    if worst_moved > 0:
        raise SyncError(f"step {step}: the trainer's log-probs moved by {worst_moved:.3g} nats and the "
                        f"sampler's did not change (difference {worst_diff:.3g}, --sync-tolerance {tolerance:g}): "
                        f"the weight sync never reached the sampler")
    return {"sync/logprob_diff": worst_diff, **per_rank({"sync/logprob_diff": probe.diff}, device)}
