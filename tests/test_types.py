"""Typed records: grouping, joining micro-batches, the token-drift check."""

from __future__ import annotations

import pytest
import torch

from diffrl.data.tokenizer import hash_ids
from diffrl.errors import ContractError
from diffrl.types import PromptBatch, TrainBatch, Trajectory, check_token_hashes, images_to_uint8


def prompts(n: int = 2) -> PromptBatch:
    ids = torch.arange(n * 3).view(n, 3) + 2
    return PromptBatch(
        texts=tuple(f"p{i}" for i in range(n)),
        input_ids=ids,
        ids_hash=tuple(hash_ids(ids)),
        prompt_ids=torch.arange(n) + 10,
    )


def traj(version: int = 0, n: int = 2) -> Trajectory:
    p = prompts(n).repeat(2)
    return Trajectory(
        prompts=p,
        group=torch.arange(n).repeat_interleave(2),
        seeds=torch.arange(2 * n),
        x0=torch.zeros(2 * n, 3, 2, 2),
        sigmas=torch.linspace(1, 0, 3),
        policy_version=version,
        log_probs=torch.zeros(2 * n, 2),
        extra_fields={"image": torch.zeros(2 * n, 2, 2, 3, dtype=torch.uint8)},
    )


def test_repeat_and_select() -> None:
    p = prompts(2).repeat(3)
    assert p.texts == ("p0",) * 3 + ("p1",) * 3
    assert p.prompt_ids.tolist() == [10, 10, 10, 11, 11, 11]
    assert p.input_ids[3].tolist() == [5, 6, 7]
    s = p.select(torch.tensor([4, 0]))
    assert s.texts == ("p1", "p0") and s.ids_hash == (p.ids_hash[4], p.ids_hash[0])
    with pytest.raises(ValueError, match="input_ids"):
        PromptBatch(
            texts=("a",), input_ids=torch.zeros(2, 3), ids_hash=("h",), prompt_ids=torch.zeros(1)
        )


def test_concat_joins_micro_batches() -> None:
    a, b = traj(3, 1), traj(3, 2)
    joined = Trajectory.concat([a, b])
    assert len(joined) == 6
    assert joined.prompts.texts == a.prompts.texts + b.prompts.texts
    assert joined.extra_fields["image"].shape == (6, 2, 2, 3)
    assert joined.log_probs.shape == (6, 2) and joined.latents is None
    assert Trajectory.concat([a]) is a
    with pytest.raises(ValueError, match="different policy versions"):
        Trajectory.concat([traj(1), traj(2)])


def test_token_hash_check() -> None:
    p = prompts(3)
    batch = TrainBatch(
        input_ids=p.input_ids,
        ids_hash=p.ids_hash,
        x0=torch.zeros(3, 1, 1, 1),
        weights=torch.ones(3),
        seeds=torch.arange(3),
    )
    check_token_hashes(batch, hash_ids)  # unchanged ids pass
    ids = p.input_ids.clone()
    ids[1, 2] = 0
    bad = TrainBatch(
        input_ids=ids, ids_hash=p.ids_hash, x0=batch.x0, weights=batch.weights, seeds=batch.seeds
    )
    with pytest.raises(ContractError, match=r"rows \[1\]"):
        check_token_hashes(bad, hash_ids)


def test_images_to_uint8_golden() -> None:
    x = torch.tensor([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0]).view(1, 1, 2, 3).expand(1, 3, 2, 3)
    img = images_to_uint8(x)
    assert img.shape == (1, 2, 3, 3) and img.dtype == torch.uint8
    assert img[0, :, :, 0].flatten().tolist() == [0, 0, 128, 191, 255, 255]
