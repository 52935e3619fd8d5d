"""Typed records: grouping, row selection and joining, the token-drift check."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from dataclasses import replace

import pytest
import torch

from diffrl.errors import ContractError
from diffrl.tasks.shapes.tokenizer import hash_ids
from diffrl.types import (
    PromptBatch,
    ScoredBatch,
    StepSpec,
    TrainBatch,
    Trajectory,
    check_token_hashes,
    concat_rows,
    hash_cond_rows,
    images_to_uint8,
    select_rows,
    train_batch,
)


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
        optimality=torch.ones(3),
        seeds=torch.arange(3),
    )
    check_token_hashes(batch)  # unchanged ids pass
    ids = p.input_ids.clone()
    ids[1, 2] = 0
    bad = TrainBatch(
        input_ids=ids,
        ids_hash=p.ids_hash,
        x0=batch.x0,
        optimality=batch.optimality,
        seeds=batch.seeds,
    )
    with pytest.raises(ContractError, match=r"token drift at the actor: input_ids of rows \[1\]"):
        check_token_hashes(bad)
    with pytest.raises(ContractError, match=r"token drift at the rollout engine: input_ids"):
        check_token_hashes(replace(p, input_ids=ids), "the rollout engine")


def cond_prompts(n: int = 3) -> PromptBatch:
    """Prompts with FL2VA-like conditions, hashed where they are made (as PromptSet does)."""
    cond = torch.linspace(-1, 1, n * 2 * 3 * 4).view(n, 2, 3, 1, 2, 2)  # (B, 2, C, 1, h, w)
    return replace(prompts(n), cond=cond, cond_hash=hash_cond_rows(cond))


def test_cond_hash_is_exact_and_fixed() -> None:
    cond = cond_prompts().cond
    h = hash_cond_rows(cond)
    assert len(set(h)) == 3 and all(len(x) == 16 for x in h)
    # the same values in bf16-exact dtypes and on another layout hash alike (float32 bytes)
    assert hash_cond_rows(cond.double()) == h
    assert hash_cond_rows(cond.transpose(1, 2).contiguous().transpose(1, 2)) == h
    halves = torch.full((1, 4), 0.5)
    assert hash_cond_rows(halves.bfloat16()) == hash_cond_rows(halves)
    # one ulp in one value, or another shape of the same values, changes the row's hash
    nudged = cond.clone()
    nudged[1, 1, 2, 0, 1, 1] = torch.nextafter(nudged[1, 1, 2, 0, 1, 1], torch.tensor(2.0))
    assert [a == b for a, b in zip(hash_cond_rows(nudged), h, strict=True)] == [True, False, True]
    assert hash_cond_rows(cond.reshape(3, 2, 3, 4)) != h
    # by definition: sha256 of the row's shape and its little-endian float32 bytes, whatever the
    # platform's own byte order
    row = b"(2,)" + struct.pack("<2f", 1.5, -0.0)
    want = hashlib.sha256(row).hexdigest()[:16]
    assert hash_cond_rows(torch.tensor([[1.5, -0.0]], dtype=torch.float64)) == (want,)


def test_cond_hashes_travel_and_a_changed_frame_raises() -> None:
    p = cond_prompts(3)
    r = p.repeat(2)
    assert r.cond_hash == tuple(h for h in p.cond_hash for _ in range(2))
    check_token_hashes(r.select(torch.tensor([5, 0])), "the rollout engine")
    t = replace(traj(), prompts=r, x0=torch.zeros(6, 3, 2, 2), seeds=torch.arange(6))
    t = replace(t, group=torch.arange(3).repeat_interleave(2), log_probs=torch.zeros(6, 2))
    t = replace(t, extra_fields={})
    scored = ScoredBatch(t, torch.zeros(6), {}, torch.ones(6, dtype=torch.bool))
    batch = train_batch(scored)
    assert batch.cond_hash == r.cond_hash
    check_token_hashes(batch)
    frame = batch.cond.clone()
    frame[3, 0] += 0.25  # the first keyframe of row 3 changed on the way
    with pytest.raises(ContractError, match=r"token drift at the actor: cond .* rows \[3\]"):
        check_token_hashes(replace(batch, cond=frame))
    with pytest.raises(ContractError, match="cond was dropped"):
        check_token_hashes(replace(batch, cond=None))
    with pytest.raises(ContractError, match="without the data stage's cond_hash"):
        check_token_hashes(replace(batch, cond_hash=None))
    with pytest.raises(ValueError, match="cond_hash"):
        replace(p, cond_hash=None)  # a PromptBatch is made with both or neither


def test_images_to_uint8_golden() -> None:
    x = torch.tensor([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0]).view(1, 1, 2, 3).expand(1, 3, 2, 3)
    img = images_to_uint8(x)
    assert img.shape == (1, 2, 3, 3) and img.dtype == torch.uint8
    assert img[0, :, :, 0].flatten().tolist() == [0, 0, 128, 191, 255, 255]


# --- select_rows / concat_rows -----------------------------------------------------------------


def rich_traj(n: int = 3) -> Trajectory:
    """Every per-row and shared field filled: latents, log-probs, an SDE spec, two media."""
    b, t = 2 * n, 2
    return replace(
        traj(5, n),
        x0=torch.randn(b, 3, 2, 2),
        latents=torch.randn(b, t + 1, 3, 2, 2),
        log_probs=torch.randn(b, t),
        sde_mask=torch.tensor([True, False]),
        step_spec=StepSpec("flow_grpo", 0.7, 4.5, (1, 0, 0)),
        extra_fields={
            "image": torch.randint(0, 255, (b, 2, 2, 3), dtype=torch.uint8),
            "fps": torch.arange(b).float(),
        },
    )


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN (missing scores are NaN)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.is_floating_point() and not torch.equal(x.isnan(), y.isnan()):
        return False
    return (
        torch.equal(x.nan_to_num(), y.nan_to_num()) if x.is_floating_point() else torch.equal(x, y)
    )


def assert_same(a, b) -> None:
    """Field-by-field equality of two records (tensors bitwise, nested records recursively)."""
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            assert_same(x, y)
        elif isinstance(x, dict):
            assert x.keys() == y.keys(), f.name
            for k in x:
                assert same(x[k], y[k]), (f.name, k)
        elif isinstance(x, torch.Tensor):
            assert same(x, y), f.name
        else:
            assert x == y, f.name


def test_select_rows_picks_rows_and_keeps_shared_fields() -> None:
    t = rich_traj(3)
    idx = torch.tensor([4, 0, 5])
    s = select_rows(t, idx)
    assert s.prompts.texts == tuple(t.prompts.texts[i] for i in idx.tolist())
    assert s.prompts.ids_hash == tuple(t.prompts.ids_hash[i] for i in idx.tolist())
    for name in ("group", "seeds", "x0", "latents", "log_probs"):
        assert torch.equal(getattr(s, name), getattr(t, name)[idx]), name
    torch.testing.assert_close(s.prompts.input_ids, t.prompts.input_ids[idx])
    assert s.extra_fields.keys() == {"image", "fps"}
    for k, v in t.extra_fields.items():
        assert torch.equal(s.extra_fields[k], v[idx]), k
    # shared fields are the trajectory's own, untouched
    assert s.sigmas is t.sigmas and s.sde_mask is t.sde_mask
    assert s.step_spec == t.step_spec and s.policy_version == 5
    assert len(select_rows(t, torch.tensor([], dtype=torch.int64))) == 0


def test_concat_rows_inverts_select_rows() -> None:
    t = rich_traj(3)
    parts = [select_rows(t, torch.arange(0, 2)), select_rows(t, torch.arange(2, 6))]
    assert_same(concat_rows(parts), t)
    assert_same(Trajectory.concat(parts), t)
    # any order: joining selections is selecting the joined index
    a, b = torch.tensor([5, 1]), torch.tensor([0, 3, 2])
    assert_same(
        concat_rows([select_rows(t, a), select_rows(t, b)]), select_rows(t, torch.cat([a, b]))
    )


def test_scored_batch_round_trip() -> None:
    t = rich_traj(2)
    scored = ScoredBatch(
        traj=t,
        rewards=torch.arange(4).float(),
        per_scorer={"a": torch.tensor([0.1, 0.2, float("nan"), 0.4]), "b": torch.ones(4)},
        valid=torch.tensor([True, True, False, True]),
    )
    idx = torch.tensor([3, 1])
    s = select_rows(scored, idx)
    assert s.rewards.tolist() == [3.0, 1.0] and s.valid.tolist() == [True, True]
    assert s.per_scorer["a"].tolist() == pytest.approx([0.4, 0.2])
    assert_same(s.traj, select_rows(t, idx))  # the nested trajectory is selected alike
    parts = [select_rows(scored, torch.tensor([0])), select_rows(scored, torch.tensor([1, 2, 3]))]
    assert_same(concat_rows(parts), scored)
    assert_same(ScoredBatch.concat(parts), scored)


def test_train_batch_round_trip_and_select() -> None:
    t = rich_traj(2)
    scored = ScoredBatch(t, torch.arange(4).float(), {}, torch.ones(4, dtype=torch.bool))
    batch = train_batch(scored, optimality=torch.rand(4), noise_key=torch.tensor([7, 7, 9, 9]))
    assert batch.advantages is None and batch.rewards is None and batch.pairs is None
    assert torch.equal(batch.latents, t.latents) and batch.sigmas is t.sigmas
    assert batch.step_spec == t.step_spec and batch.sde_mask is t.sde_mask
    idx = torch.tensor([2, 0, 3])
    s = batch.select(idx)
    for name in ("input_ids", "x0", "seeds", "group", "optimality", "noise_key", "latents"):
        assert torch.equal(getattr(s, name), getattr(batch, name)[idx]), name
    assert s.ids_hash == tuple(batch.ids_hash[i] for i in idx.tolist())
    assert s.sigmas is batch.sigmas and s.step_spec == batch.step_spec and s.advantages is None
    parts = [batch.select(torch.arange(0, 1)), batch.select(torch.arange(1, 4))]
    assert_same(concat_rows(parts), batch)
    moved = batch.select(idx, device="cpu")
    assert_same(moved, s)


def test_train_batch_select_reindexes_pairs() -> None:
    scored = ScoredBatch(rich_traj(2), torch.arange(4).float(), {}, torch.ones(4, dtype=torch.bool))
    pairs = torch.tensor([[3, 0], [2, 1]])
    batch = replace(train_batch(scored, rewards=scored.rewards), pairs=pairs)
    s = batch.select(pairs.flatten())  # [w0, l0, w1, l1]
    assert s.rewards.tolist() == [3.0, 0.0, 2.0, 1.0]
    assert s.pairs.tolist() == [[0, 1], [2, 3]]
