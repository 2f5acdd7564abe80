"""The prompt stream that ``Trainer.fit`` iterates: one ``PromptBatch`` per RL step."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class PromptBatch:
    """The prompts of RL step ``step``: indices into the task's training examples."""

    step: int
    indices: list[int]


class PromptStream:
    """Yields ``PromptBatch`` for steps ``start_step .. total_steps - 1``.

    Step ``s`` covers positions ``[s * P, (s + 1) * P)`` of an endless sequence of epochs, each a
    permutation of the examples seeded by ``(seed, epoch)``. Any step's batch is computed from
    its number alone, so a resumed run is handed exactly the prompts it would have seen, with no
    iterator state to save.
    """

    def __init__(self, num_examples: int, prompts_per_step: int, total_steps: int, seed: int = 0, start_step: int = 0):
        if num_examples < 1:
            raise ValueError("the task has no training examples")
        self.num_examples = num_examples
        self.prompts_per_step = prompts_per_step
        self.total_steps = total_steps
        self.seed = seed
        self.start_step = start_step
        self._epoch_cache: dict[int, list[int]] = {}

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._epoch_cache:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch_cache = {epoch: torch.randperm(self.num_examples, generator=gen).tolist()}
        return self._epoch_cache[epoch]

    def batch(self, step: int) -> PromptBatch:
        first = step * self.prompts_per_step
        indices = []
        for position in range(first, first + self.prompts_per_step):
            epoch, offset = divmod(position, self.num_examples)
            indices.append(self._epoch_order(epoch)[offset])
        return PromptBatch(step=step, indices=indices)

    def __iter__(self) -> Iterator[PromptBatch]:
        for step in range(self.start_step, self.total_steps):
            yield self.batch(step)


class EvalBatches:
    """Fixed held-out batches for validation (the same every time, so accuracy is comparable).

    A class rather than a list: Lightning reads a list of iterables as several dataloaders.
    """

    def __init__(self, num_examples: int, batch_size: int) -> None:
        self.batches = [list(range(i, min(i + batch_size, num_examples))) for i in range(0, num_examples, batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def minibatch_chunks(rows: torch.Tensor, epochs: int, minibatches: int, seed: int) -> Iterator[torch.Tensor]:
    """The optimizer ticks of one RL step, as the row indices each tick trains on.

    ``epochs`` passes over ``rows``; with ``minibatches > 1`` each pass is a seeded shuffle split
    into ``minibatches`` near-equal chunks (empty chunks, when there are fewer rows than
    minibatches, are skipped). One generator seeded with ``seed`` drives every pass, so the one-
    and multi-process trainers tick through the same chunks."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = rows[torch.randperm(len(rows), generator=generator)] if minibatches > 1 else rows
        for chunk in torch.tensor_split(order, minibatches):
            if len(chunk):
                yield chunk
