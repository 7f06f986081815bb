"""Training data of the GPU job: synthetic token windows or a Megatron indexed dataset.

Synthetic data is a seeded generator per data-parallel rank and sample (no download);
``--data-path`` cuts windows of ``seq_length + 1`` tokens from the dataset's token stream.
Both are resumable: the stream of a given iteration does not depend on what ran before.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch

from uccl_ep_megatron.core.errors import InvalidInputError


class TokenWindows:
    """Windows of ``seq_length + 1`` consecutive tokens of an indexed dataset's token stream.

    Documents are concatenated in order (as Megatron's GPT dataset does before sampling), so
    every window is full; window ``i`` starts at token ``i * (seq_length + 1)``.
    """

    def __init__(self, prefix: str, seq_length: int) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.dataset = IndexedDataset(prefix)
        self.lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)])
        self.window = seq_length + 1
        self.num_windows = int(self.starts[-1] // self.window)
        if self.num_windows == 0:
            raise InvalidInputError(
                f"--data-path {prefix!r} holds {int(self.starts[-1])} tokens, fewer than one "
                f"sequence of {self.window}; use a larger dataset or a shorter seq_length"
            )

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> np.ndarray:
        pos = (i % self.num_windows) * self.window
        out, need = [], self.window
        doc = int(np.searchsorted(self.starts, pos, side="right") - 1)
        offset = pos - int(self.starts[doc])
        while need:
            take = min(need, int(self.lengths[doc]) - offset)
            if take > 0:
                out.append(np.asarray(self.dataset.get(doc, offset=offset, length=take)))
                need -= take
            doc, offset = doc + 1, 0
        return np.concatenate(out).astype(np.int64)


def batches(
    recipe, par: dict[str, int], dp_rank: int, start_iter: int, data_path: str | None, device
) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of this data-parallel rank from iteration ``start_iter`` on (resumable)."""
    seq = int(recipe.model["seq_length"])
    mb = int(recipe.training["micro_batch_size"])
    nmb = par["num_microbatches"]
    gb = int(recipe.training["global_batch_size"])
    vocab = int(recipe.model["vocab_size"])
    windows = TokenWindows(data_path, seq) if data_path else None
    seed = int(recipe.training.get("seed") or 1234)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(mb, -1)
    it = start_iter
    while True:
        for k in range(nmb):
            first = it * gb + dp_rank * mb * nmb + k * mb  # this micro-batch's global samples
            if windows is not None:
                rows = np.stack([windows[first + j] for j in range(mb)])
                tokens = torch.from_numpy(rows).to(device, non_blocking=True)
            else:
                g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + first)
                tokens = torch.randint(0, vocab, (mb, seq + 1), generator=g, device=device)
            yield {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(mb, seq, dtype=torch.float32, device=device),
                "position_ids": position_ids,
                "attention_mask": mask,
            }
        it += 1


def forward_step(data_iterator, model):
    b = next(data_iterator)
    output = model(
        b["tokens"],
        b["position_ids"],
        b["attention_mask"],
        labels=b["labels"],
        loss_mask=b["loss_mask"],
    )
    return output, functools.partial(loss_func, b["loss_mask"])


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    losses = output.float().view(-1)
    mask = loss_mask.view(-1)
    total = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}


__all__ = ["TokenWindows", "batches", "forward_step", "loss_func"]
