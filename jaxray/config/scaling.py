"""How a trial scales: its Ray Train workers and their accelerator (``WorkersConfig``), and the
(``data``, ``fsdp``, ``tensor``) mesh over their devices (``ParallelConfig``)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, Strict, field_validator, model_validator

from jaxray.argtypes import MAX_CPU_DEVICES
from jaxray.config.types import FrozenConfig, PosFloat, PosInt

COMPILE_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable: an unset compile_cache reads it


def _worker_count(value: Any) -> Any:
    """``num_workers`` as given: a positive integer, or [min, max] of them; ValueError saying so."""
    pair = isinstance(value, list | tuple)
    items = list(value) if pair else [value]
    positive = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in items)
    if not positive or (pair and len(items) != 2):
        raise ValueError("num_workers must be a positive integer or [min, max] of them")
    return tuple(items) if pair else value


Accelerator = Literal["cpu", "gpu", "tpu"]
TPU_CHIPS_PER_HOST = (1, 2, 4, 8)  # what Ray 2.60 lets one worker ask for ({"TPU": n})
RAY_RESIZE_INTERVAL_S = 60.0  # Ray Train's elastic_resize_monitor_interval_s default


class WorkersConfig(FrozenConfig):
    """Ray Train scaling: ``num_workers`` JAX processes, or ``[min, max]`` of them (Ray's elastic
    ``ScalingConfig``: fewer while nodes are missing, the same global batch), each owning
    ``devices_per_worker`` devices of ``accelerator``. A TPU slice of several hosts names its
    ``topology`` ("4x4") and ``accelerator_type`` ("TPU-V5LITEPOD"), as Ray's ``ScalingConfig``
    requires. ``compile_cache``: JAX's persistent compilation cache folder for every trial ("" turns
    it off; default ``jaxray.train.compile_cache.default_folder``)."""

    num_workers: Annotated[int | tuple[int, int], BeforeValidator(_worker_count)] = 1
    devices_per_worker: PosInt = 1
    accelerator: Accelerator = "cpu"
    topology: str | None = None
    accelerator_type: str | None = None
    compile_cache: str | None = None
    # Worker-group restarts after a worker or its node dies (-1: no limit); the loop resumes from
    # the newest checkpoint. Preemptions (a drain notice, then the node gone) are counted apart.
    max_failures: Annotated[int, Strict(), Field(ge=-1)] = 1
    max_preemption_failures: Annotated[int, Strict(), Field(ge=-1)] = -1
    # Sweeps: Tune's restarts of a trial whose driver died with its node (-1: no limit).
    max_driver_failures: Annotated[int, Strict(), Field(ge=-1)] = 1
    # Elastic only: how often Ray checks whether more workers fit again, seconds (Ray's default).
    elastic_resize_monitor_interval_s: PosFloat = RAY_RESIZE_INTERVAL_S

    @field_validator("compile_cache")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        """A folder as an absolute path (the workers start elsewhere, as ``data_dir``); a URI, "" as given."""
        return value if not value or "://" in value else str(Path(value).expanduser().absolute())

    @model_validator(mode="after")
    def _cpu_devices(self) -> WorkersConfig:
        low, high = self.worker_range
        if low > high:
            raise ValueError(f"num_workers [min, max] needs min <= max, got [{low}, {high}]")
        # Another value with fixed workers would do nothing (a saved run's config holds the default).
        if low == high and self.elastic_resize_monitor_interval_s != RAY_RESIZE_INTERVAL_S:
            raise ValueError(
                f"elastic_resize_monitor_interval_s applies to elastic workers only (num_workers: [min, "
                f"max]), not to a fixed num_workers {high}"
            )
        if self.accelerator == "cpu" and self.devices_per_worker > MAX_CPU_DEVICES:
            raise ValueError(
                f"devices_per_worker must be at most {MAX_CPU_DEVICES} forced host devices on CPU "
                f"(accelerator cpu), got {self.devices_per_worker}; use more workers instead"
            )
        if self.accelerator == "tpu" and self.devices_per_worker not in TPU_CHIPS_PER_HOST:
            raise ValueError(
                f"devices_per_worker (TPU chips per worker) must be one of {TPU_CHIPS_PER_HOST} with "
                f"accelerator tpu, got {self.devices_per_worker}"
            )
        if self.compile_cache is not None and (error := compile_cache_error(self.compile_cache)) is not None:
            raise ValueError(error)
        slice_keys = {"topology": self.topology, "accelerator_type": self.accelerator_type}
        if self.accelerator != "tpu" and any(v is not None for v in slice_keys.values()):
            given = ", ".join(k for k, v in slice_keys.items() if v is not None)
            raise ValueError(f"{given}: TPU slice keys, they need accelerator tpu, not {self.accelerator}")
        if self.accelerator == "tpu" and high > 1 and None in slice_keys.values():
            raise ValueError(
                f"num_workers {high} TPU workers form a multi-host slice: Ray needs workers.topology "
                f"(e.g. '4x4') and workers.accelerator_type (e.g. 'TPU-V5LITEPOD'), got {slice_keys}"
            )
        return self

    @property
    def worker_range(self) -> tuple[int, int]:
        """(min, max) workers; both ``num_workers`` when it is one number."""
        n = self.num_workers
        return (n, n) if isinstance(n, int) else n

    @property
    def elastic(self) -> bool:
        return self.worker_range[0] != self.worker_range[1]

    @property
    def total_devices(self) -> int:
        """Devices of the trial at its most workers."""
        return self.worker_range[1] * self.devices_per_worker


AxisSize = Annotated[int, Strict(), Field(ge=-1)]
MESH_AXES = ("data", "fsdp", "tensor")


class ParallelConfig(FrozenConfig):
    """The trial's (``data``, ``fsdp``, ``tensor``) device mesh (``jaxray.parallel.mesh``): sizes whose
    product is the trial's device count over all its workers; one of them may be -1, the rest.
    ``data`` left out is the rest, or 1 when ``fsdp`` or ``tensor`` is -1 (default: every device on
    ``data``). ``fsdp`` splits params and optimizer state on their ``embed`` dimension, ``tensor``
    on ``heads``, ``mlp`` and ``vocab`` (``jaxray.parallel.mesh.RULES``); batches are split over
    ``data`` x ``fsdp``. ``data`` and ``fsdp`` may span workers, ``tensor`` stays within one."""

    data: AxisSize | None = None
    fsdp: AxisSize = 1
    tensor: AxisSize = 1

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        given = {a: getattr(self, a) for a in MESH_AXES if getattr(self, a) is not None}
        if any(n == 0 for n in given.values()) or list(given.values()).count(-1) > 1:
            raise ValueError(f"parallel sizes must be positive, with at most one -1 (the rest); got {given}")
        return self

    def shape(self, devices: int) -> dict[str, int]:
        """``{data, fsdp, tensor}`` sizes on ``devices`` devices, the -1 resolved; ValueError naming the
        numbers when their product cannot be ``devices``."""
        data = self.data if self.data is not None else (1 if -1 in (self.fsdp, self.tensor) else -1)
        sizes = {"data": data, "fsdp": self.fsdp, "tensor": self.tensor}
        known = math.prod(n for n in sizes.values() if n != -1)
        if -1 in sizes.values() and devices % known == 0:
            return {a: devices // known if n == -1 else n for a, n in sizes.items()}
        if -1 not in sizes.values() and known == devices:
            return sizes
        named = [a for a in MESH_AXES if a != "data" or self.data is not None]
        given = " x ".join(f"parallel.{a} {sizes[a]}" for a in named)
        need = (
            f"the fixed sizes' product ({known}) must divide {devices}"
            if -1 in sizes.values()
            else f"their product ({known}) must be {devices}, or one size -1 for the rest"
        )
        raise ValueError(
            f"{given} cannot make a mesh of the trial's {devices} devices (workers.num_workers x "
            f"workers.devices_per_worker): {need}"
        )


def compile_cache_error(setting: str | None) -> str | None:
    """Why ``compile_cache`` (None: ``$JAX_COMPILATION_CACHE_DIR``, as ``compile_cache.folder_for``
    reads it) cannot be a folder: a file at it or at its nearest existing parent. None when it can
    be made, or is a URI (never a local file), or is off, or a parent cannot be read (left to the
    first compile). The variable is read where an experiment is planned (``ExperimentConfig.plans``),
    not when a saved trial config is read back."""
    cache = os.environ.get(COMPILE_CACHE_ENV) if setting is None else setting
    if not cache or "://" in cache:
        return None
    path = Path(cache).expanduser().absolute()
    try:
        found = next((p for p in (path, *path.parents) if p.exists()), None)
        if found is None or found.is_dir():
            return None
    except OSError:  # a parent this user cannot read
        return None
    named = "compile_cache" if setting is not None else f"compile_cache (unset: ${COMPILE_CACHE_ENV})"
    where = "is a file" if found == path else f"is inside the file {found}"
    return f"{named} {cache!r} {where}: give a folder, or '' for none"
