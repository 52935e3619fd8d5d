"""What the machine can take, checked before a run writes anything: a run directory that can
hold files, a step whose records fit in memory, and a LoRA rank the model's layers can use.

Each check raises ``ConfigError`` naming the config key, the value and the bound. The bounds
are floors of what the run needs, never estimates of it, so a run they let through may still
run out of memory (``diffrl plan`` estimates that), but one they refuse could never have run.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from diffrl.diskio import sized
from diffrl.errors import ConfigError

# kernel filesystems: writable by root in places (/dev), but not where files of a run belong
SPECIAL_FILESYSTEMS = frozenset(
    {
        "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
        "securityfs", "configfs", "bpf", "pstore", "mqueue", "hugetlbfs", "fusectl", "autofs",
        "binfmt_misc", "efivarfs", "rpc_pipefs", "nsfs",
    }
)  # fmt: skip


def check_out_dir(out_dir: str) -> None:
    """``run.out_dir`` can hold a run: not on a kernel filesystem, and a file can be created
    there (in its nearest existing ancestor when it does not exist yet). The probe file has a
    temporary name and is removed at once, so nothing of the run is written."""
    path = Path(out_dir).expanduser().absolute()
    here = path
    while not here.exists() and here != here.parent:
        here = here.parent
    bad = f"config key 'run.out_dir' = {out_dir!r}:"
    fs = filesystem_type(here)
    if fs in SPECIAL_FILESYSTEMS:
        raise ConfigError(
            f"{bad} {here} is on the kernel's {fs} filesystem; give a directory on a disk"
        )
    if not here.is_dir():
        raise ConfigError(f"{bad} {here} is not a directory; give a directory to hold runs")
    try:
        fd, probe = tempfile.mkstemp(prefix=".diffrl-probe-", dir=here)
    except OSError as e:
        raise ConfigError(
            f"{bad} cannot create files in {here} ({e.strerror}); give a writable directory"
        ) from None
    os.close(fd)
    os.unlink(probe)


def filesystem_type(path: Path) -> str:
    """The type of the filesystem mounted at ``path``'s longest mount-point prefix ("" where
    the mount table cannot be read: not Linux)."""
    best, fs = "", ""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    target = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fs = mount, parts[2]
    return fs


def machine_memory(device: torch.device) -> int:
    """Bytes of memory a step's records could live in: the host's physical memory, plus the
    GPU's on a CUDA device."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type == "cuda":
        total += torch.cuda.get_device_properties(device).total_memory
    return total


def check_step_rows(
    prompts_per_step: int,
    group_size: int,
    latent_shape: Sequence[int],
    itemsize: int,
    memory: int,
    ranks: int = 1,
) -> None:
    """A step keeps at least every sample's final latent until its update: ``prompts_per_step
    x group_size`` rows of ``latent_shape`` elements, split over ``ranks`` data-parallel
    processes. Refuse a step whose latents alone exceed a process's ``memory`` bytes."""
    rows = prompts_per_step * group_size
    row_bytes = math.prod(latent_shape) * itemsize
    need = -(-rows // ranks) * row_bytes  # a rank's share, rounded up
    if need <= memory:
        return
    shape = "x".join(str(d) for d in latent_shape)
    split = f" over {ranks} data-parallel ranks" if ranks > 1 else ""
    raise ConfigError(
        f"config keys 'data.prompts_per_step' x 'rollout.group_size' = {prompts_per_step} x "
        f"{group_size} = {rows} samples a step{split}: their final latents alone ({shape}, "
        f"{sized(row_bytes)} each) need {sized(need)}{' a rank' if split else ''}, more than "
        f"this machine's {sized(memory)} of memory; lower them"
    )


def check_lora_rank(rank: int, widths: dict[str, tuple[int, int]]) -> None:
    """A LoRA factor pair on an (in, out) Linear has rank at most min(in, out); a rank above
    that of every target layer only adds parameters that cannot change the update's rank."""
    if not widths:
        return
    name, (fan_in, fan_out) = max(widths.items(), key=lambda kv: min(kv[1]))
    most = min(fan_in, fan_out)
    if rank > most:
        raise ConfigError(
            f"config key 'actor.lora.rank' = {rank}: must be <= {most}, the largest rank any "
            f"target layer can take ({name}: {fan_in} -> {fan_out}, rank <= min(in, out))"
        )


def check_model_fits(
    cfg, model: torch.nn.Module, targets: Sequence[str], device, ranks: int = 1
) -> None:
    """The checks that need the loaded model: the LoRA rank against the target layers'
    widths, and a step's latents against the machine's memory. ``cfg`` is the run's Config;
    ``targets`` the full module names the adapters go on; ``ranks`` the data-parallel ranks
    a step's samples are split over."""
    modules = dict(model.named_modules())
    widths = {
        n: (modules[n].in_features, modules[n].out_features)
        for n in targets
        if isinstance(modules.get(n), torch.nn.Linear)
    }
    check_lora_rank(cfg.actor.lora.rank, widths)
    itemsize = next(model.parameters()).element_size()
    check_step_rows(
        cfg.data.prompts_per_step,
        cfg.rollout.group_size,
        model.family.latent_shape(),
        itemsize,
        machine_memory(torch.device(device)),
        ranks,
    )
