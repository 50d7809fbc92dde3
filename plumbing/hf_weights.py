"""The HF sampler's weights, which rollout.py's HFSampler inherits: the trainer -> sampler sync (update_weights),
sleep and wake (its memory goes to training), and the checksums plumbing/sync.py compares. Sampling is rollout.py's.

    python -m pytest tests/test_rollout.py
"""

import torch

from plumbing.sync import module_checksums


class SamplerWeights:
    """Needs self.model, self.shapes ({name: shape} of every weight), self.dtype and self.fast (speed/cpu_sampler's
    FastPath, or None)."""

    @torch.no_grad()
    def update_weights(self, named_tensors):
        # lm_head.weight is the embedding matrix itself when tied, so copying either name updates both.
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in named_tensors:
            if tensor.shape != self.shapes[name]:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, the sampler's "
                                 f"{tuple(self.shapes[name])}")
            param = params[name]
            if not (self.fast and self.fast.load(name, tensor)):  # a weight kept only packed is packed from it
                if param.shape != tensor.shape:  # asleep: its storage was given back
                    param.data = torch.empty_like(tensor, dtype=param.dtype, device=param.device)
                param.copy_(tensor.to(param.device, param.dtype))
            del tensor  # gone before the next one is gathered: the sync holds one full parameter
        missing = self._empty_weights()
        if missing:
            raise ValueError(f"update_weights left {len(missing)} weights of the sleeping sampler empty, "
                             f"e.g. {missing[0]}")
        if self.fast:
            self.fast.repack(self.model)

    def _empty_weights(self) -> list[str]:
        """The weights with no storage: every one while asleep, those a sync left out after it."""
        return [name for name, p in self.model.named_parameters(remove_duplicate=False)
                if (self.fast.empty(name) if self.fast and self.fast.owns(name) else p.shape != self.shapes[name])]

    def sleep(self) -> int:
        """Frees the weights, dead until update_weights brings the new ones, so that training can use their memory.
        Returns the bytes freed."""
        freed = 0
        for p in self.model.parameters():  # a tied lm_head is the embedding's parameter: freed once
            freed += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return freed + (self.fast.sleep(self.model) if self.fast else 0)

    def wake(self):
        pass  # update_weights reallocates: the weights arrive with it

    def device(self) -> torch.device:
        """The device this sampler's model lives on (scripts/gpu_check.sh: no two ranks' engines share one)."""
        return self.model.device

    def weight_checksums(self, shapes) -> dict:
        """{name: checksum} of the weights it computes with (plumbing/sync.py: check_weights)."""
        return module_checksums(self.model, self.dtype)

    def close(self):
        del self.model
