"""Parallel degrees and the device meshes built from them.

One process per device. The world of ``world_size`` ranks is laid out twice:

* the **main mesh**, for the DiT, with named axes ``("dp_replicate", "dp_shard", "sp", "tp")``
  (outermost first, so ``tp`` groups are consecutive ranks, where the fastest links are).
  Every axis is present, size 1 included, so code can always ask for ``mesh["tp"]``.
  ``dp_replicate`` x ``dp_shard`` is FSDP2/HSDP (``fully_shard`` over
  :attr:`Meshes.fsdp_mesh`); ``sp`` is Ulysses sequence parallelism (an all-to-all that
  swaps a sequence shard for a head shard); ``tp`` is DTensor tensor parallelism.
* the **ETP mesh**, for a large frozen text encoder, on a mesh of its own: the world cut into
  groups of ``etp`` consecutive ranks, each a 1-D mesh ``("etp",)``. The encoder runs once per
  prompt before the DiT, so its groups need not line up with any axis of the main mesh, and
  its collectives run on communicators of their own (a separate process group even where the
  ranks are the same as a ``tp`` group).

``ParallelDims.validate`` checks every degree against the world and the model *before* any
process group exists, so a bad layout fails in a second with the key to change, not after
minutes of loading weights or as a hang inside a collective.

Anchor: torchtitan's ``ParallelDims`` (``distributed/parallel_dims.py``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from diffrl.errors import ConfigError

# The config section these keys live under; error messages name the full key.
KEY = "parallel"
MAIN_AXES = ("dp_replicate", "dp_shard", "sp", "tp")  # outermost first
ETP_AXIS = "etp"
AXES = (*MAIN_AXES, ETP_AXIS)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _as_tuple(heads: int | Sequence[int] | None) -> tuple[int, ...]:
    if heads is None:
        return ()
    return (heads,) if isinstance(heads, int) else tuple(heads)


@dataclass(frozen=True)
class ParallelDims:
    """How many ways each kind of parallelism splits the world.

    The main-mesh degrees multiply to ``world_size``; ``etp`` splits the same world on its own.
    """

    dp_replicate: int = 1  # HSDP replicas of the sharded model; gradients all-reduced across
    dp_shard: int = -1  # FSDP2 shards within a replica; -1 = whatever the other axes leave
    sp: int = 1  # Ulysses sequence parallelism: sequence shards, all-to-all over the DiT's heads
    tp: int = 1  # tensor parallelism of the DiT (the family's TP plan)
    etp: int = 1  # tensor parallelism of the text encoder, on its own mesh of consecutive ranks
    world_size: int = 1  # set by the launcher (torchrun's WORLD_SIZE); see from_env

    @classmethod
    def from_env(cls, **degrees: int) -> ParallelDims:
        """The given degrees over the launcher's world (``WORLD_SIZE``, 1 without torchrun)."""
        return cls(**degrees, world_size=int(os.environ.get("WORLD_SIZE", "1")))

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each holds a different slice of the batch."""
        return self.dp_replicate * self.dp_shard

    def validate(
        self,
        *,
        dit_heads: int | None = None,
        encoder_heads: int | Sequence[int] | None = None,
        kv_heads: int | Sequence[int] | None = None,
        family_has_tp_plan: bool | None = None,
    ) -> ParallelDims:
        """Check the layout, and return a copy with ``dp_shard=-1`` resolved.

        Raises ``ConfigError`` naming the key and the fix. Needs no process group. The
        degree checks always run. Each check on the model runs only when its fact is given
        (the config loader calls ``validate()`` bare; the actor calls it again with the
        family's numbers before building any mesh):

        dit_heads:          the DiT's attention heads; ``tp`` and ``tp * sp`` must divide them
                            (TP splits heads; Ulysses then splits each TP rank's heads).
        encoder_heads:      the text encoder's query heads, one count per encoder the family
                            runs under ETP; ``etp`` must divide each.
        kv_heads:           the encoders' key/value heads (GQA), likewise.
        family_has_tp_plan: ``tp > 1`` needs a family that declares a TP plan.
        """
        for name in ("dp_replicate", "sp", "tp", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{KEY}.{name}={value!r}: must be an integer >= 1 (1 = off)")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ConfigError(
                f"{KEY}.dp_shard={self.dp_shard!r}: must be an integer >= 1, or -1 for "
                "whatever the other degrees leave of the world"
            )
        world = self.world_size
        if not isinstance(world, int) or world < 1:
            raise ConfigError(f"world_size={world!r}: must be an integer >= 1")

        rest = self.dp_replicate * self.sp * self.tp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world % rest:
                raise ConfigError(
                    f"{KEY}.dp_shard=-1 cannot be resolved: world size {world} is not divisible "
                    f"by dp_replicate*sp*tp = {self.dp_replicate}*{self.sp}*{self.tp} = {rest}; "
                    f"choose degrees whose product divides {world} "
                    f"(its divisors: {_divisors(world)})"
                )
            dp_shard = world // rest
        product = rest * dp_shard
        if product != world:
            raise ConfigError(
                f"{KEY}: dp_replicate*dp_shard*sp*tp = {self.dp_replicate}*{dp_shard}*{self.sp}"
                f"*{self.tp} = {product}, but the world size is {world}; the degrees must "
                f"multiply to the world size (set {KEY}.dp_shard=-1 to fill it)"
            )
        if world % self.etp:
            raise ConfigError(
                f"{KEY}.etp={self.etp}: the text encoder's groups of etp consecutive ranks must "
                f"tile the world of {world}; set {KEY}.etp to one of {_divisors(world)}"
            )

        if self.tp > 1 and family_has_tp_plan is False:
            raise ConfigError(
                f"{KEY}.tp={self.tp}: this model family declares no TP plan; set {KEY}.tp=1 "
                f"(shard with {KEY}.dp_shard instead)"
            )
        if dit_heads is not None:
            if dit_heads % self.tp:
                raise ConfigError(
                    f"{KEY}.tp={self.tp}: tensor parallelism splits the DiT's {dit_heads} "
                    f"attention heads, so tp must divide {dit_heads}; set {KEY}.tp to one of "
                    f"{_divisors(dit_heads)}"
                )
            local = dit_heads // self.tp
            if local % self.sp:
                per_tp = f" ({local} per TP rank at tp={self.tp})" if self.tp > 1 else ""
                raise ConfigError(
                    f"{KEY}.sp={self.sp}: Ulysses sequence parallelism trades a sequence shard "
                    f"for a head shard in an all-to-all over the DiT's {dit_heads} attention "
                    f"heads{per_tp}, so sp must divide {local}; set {KEY}.sp to one of "
                    f"{_divisors(local)}"
                )
        counts = [("attention", h) for h in _as_tuple(encoder_heads)]
        counts += [("key/value", h) for h in _as_tuple(kv_heads)]
        for kind, heads in counts:
            if heads % self.etp:
                ok = [d for d in _divisors(world) if all(h % d == 0 for _, h in counts)]
                raise ConfigError(
                    f"{KEY}.etp={self.etp}: tensor parallelism of the text encoder splits its "
                    f"{heads} {kind} heads, so etp must divide {heads}; set {KEY}.etp to one of "
                    f"{ok} (the divisors of the world size {world} that divide every encoder "
                    f"head count {[h for _, h in counts]})"
                )
        return dataclasses.replace(self, dp_shard=dp_shard)


@dataclass(frozen=True, eq=False)
class Meshes:
    """The meshes of one rank, and the few numbers the engines ask of them.

    At world size 1 both meshes are None (nothing is split, no process group is needed):
    every axis has size 1, this rank is 0 on each, and ``group`` returns None, which callers
    read as "skip this parallelism".
    """

    dims: ParallelDims  # resolved (dp_shard >= 1)
    main: DeviceMesh | None  # axes MAIN_AXES, shape (dp_replicate, dp_shard, sp, tp)
    etp: DeviceMesh | None  # 1-D ("etp",): this rank's group of etp consecutive ranks

    def size(self, axis: str) -> int:
        if axis not in AXES:
            raise KeyError(f"unknown mesh axis {axis!r}; axes: {list(AXES)}")
        return getattr(self.dims, axis)

    def rank_in(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (0 .. size-1)."""
        self.size(axis)  # names the axes on a typo
        if self.main is None:
            return 0
        if axis == ETP_AXIS:
            return self.etp.get_local_rank()
        return self.main.get_local_rank(axis)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of this rank along ``axis``; None at world size 1."""
        self.size(axis)
        if self.main is None:
            return None
        return self.etp.get_group() if axis == ETP_AXIS else self.main.get_group(axis)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the batch is split this many ways."""
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        """Which slice of the batch this rank holds (sp and tp ranks of one slice share it)."""
        return self.rank_in("dp_replicate") * self.dims.dp_shard + self.rank_in("dp_shard")

    def dp_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's data-parallel peers: the ranks with its sp and tp
        coordinates, across ``dp_replicate`` x ``dp_shard`` (one axis: that axis's group; both:
        the flattened pair, made once); None at world size 1."""
        if self.main is None:
            return None
        if self.dims.dp_replicate == 1:
            return self.main.get_group("dp_shard")
        if self.dims.dp_shard == 1:
            return self.main.get_group("dp_replicate")
        pair = self.main["dp_replicate", "dp_shard"]
        # DeviceMesh._flatten (private in torch 2.13) registers the 1-D "dp" mesh on the root
        # and returns the same one when asked again
        return pair._flatten("dp").get_group()

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh ``fully_shard`` takes: 1-D ``dp_shard`` (FSDP), or 2-D
        ``(dp_replicate, dp_shard)`` (HSDP) when there are replicas; None at world size 1."""
        if self.main is None:
            return None
        if self.dims.dp_replicate > 1:
            return self.main["dp_replicate", "dp_shard"]
        return self.main["dp_shard"]


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """Build this rank's main and ETP meshes (collective: every rank calls it, in step).

    ``dims`` is validated (degrees only; check the model's facts with ``dims.validate(...)``
    first). At world size 1 nothing is built and no process group is needed (see ``Meshes``).
    Otherwise the default process group is the launcher's: ``init_device_mesh`` starts it from
    torchrun's environment when it does not exist yet (gloo for "cpu", nccl for "cuda"), and
    its world size must be ``dims.world_size``.
    """
    dims = dims.validate()
    if dims.world_size == 1:
        return Meshes(dims, None, None)
    if dist.is_initialized() and dist.get_world_size() != dims.world_size:
        raise ConfigError(
            f"world_size={dims.world_size}, but the process group has {dist.get_world_size()} "
            "ranks; build ParallelDims with ParallelDims.from_env(...) under the launcher"
        )
    shape = tuple(getattr(dims, axis) for axis in MAIN_AXES)
    main = init_device_mesh(device_type, shape, mesh_dim_names=MAIN_AXES)
    if dist.get_world_size() != dims.world_size:
        raise ConfigError(
            f"world_size={dims.world_size}, but the launcher started {dist.get_world_size()} ranks"
        )
    # The encoder's groups: rows of a (world/etp, etp) layout are consecutive ranks; this rank
    # keeps the 1-D mesh of its own row. The outer axis only exists to make the groups.
    groups = dims.world_size // dims.etp
    etp = init_device_mesh(device_type, (groups, dims.etp), mesh_dim_names=("etp_group", ETP_AXIS))
    return Meshes(dims, main, etp[ETP_AXIS])
