"""Several processes through ``torch.distributed``: the one home of ranks, the process group and
the collectives calibration, fidelity and the exporter use.

A launcher (``torchrun``, or anything that sets the same variables) starts one process per GPU,
on one node or several, and sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. :func:`current` reads them: with no launcher (or ``WORLD_SIZE=1``) it returns the
single-process :data:`SINGLE`, whose collectives are identities, so every caller has one code path
and the default needs no launcher. With a launcher it forms the process group once per process:
backend ``nccl`` when CUDA is available (each rank on ``cuda:LOCAL_RANK``), else ``gloo``
(``FP4FORGE_DIST_BACKEND`` overrides), torn down at exit.

How work is shared and reduced (docs/distributed.md#what-is-reduced-how):

* each rank takes one contiguous block of the batches (or work units) in their original order
  (:meth:`Ranks.share`), so per-batch results are those of one process;
* amax is reduced by MAX (exact: the max does not depend on the order), token counts and
  squared-error sums by SUM, per-position metrics are gathered in batch order;
* files are written by rank 0 alone (:meth:`Ranks.on_main`), atomically as in one process, and
  every rank returns the same result.

A rank that fails tells the others at the next agreement point (:meth:`Ranks.agree`), so they stop
with a :class:`~fp4forge.errors.DistributedError` instead of waiting for the collective timeout.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fp4forge.errors import DistributedError, Fp4forgeError

if TYPE_CHECKING:  # torch loads on first use: the CLI asks `speaks()` before any command runs
    import torch

__all__ = ["BACKEND_ENV", "LAUNCHER_ENV", "SINGLE", "Ranks", "current", "launched", "shutdown", "speaks"]

T = TypeVar("T")
Op = Literal["max", "sum", "min"]
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
BACKEND_ENV = "FP4FORGE_DIST_BACKEND"
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of a run (``world_size == 1``: a single process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: no process group

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        return {"ranks": self.world_size, "backend": self.backend}

    # -- sharing work --------------------------------------------------------------------------
    def share_range(self, count: int) -> range:
        """This rank's contiguous block of ``count`` items (sizes differ by at most one)."""
        return range(count * self.rank // self.world_size, count * (self.rank + 1) // self.world_size)

    def share(self, items: Sequence[T]) -> list[T]:
        return [items[i] for i in self.share_range(len(items))]

    def require_share(self, count: int, what: str, option: str | None = None) -> None:
        """Every rank needs at least one of ``count`` items (checked alike on every rank, so all
        of them raise the same error without talking)."""
        if count < self.world_size:
            raise DistributedError(f"{count} {what} cannot be shared by {self.world_size} ranks: give every rank at least one", option=option)

    # -- collectives -----------------------------------------------------------------------------
    def _comm_device(self) -> torch.device:
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def all_reduce(self, tensor: torch.Tensor, op: Op) -> torch.Tensor:
        """The elementwise MAX / SUM / MIN of ``tensor`` over all ranks, on ``tensor``'s device."""
        if not self.distributed:
            return tensor
        import torch.distributed as dist

        ops = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}
        work = tensor.detach().to(self._comm_device(), copy=True).contiguous()
        dist.all_reduce(work, op=ops[op])
        return work.to(tensor.device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(tensor, "sum")

    def sum_int(self, value: int) -> int:
        import torch

        return int(self.all_reduce(torch.tensor([value], dtype=torch.int64), "sum")[0])

    def reduce_tensors(self, tensors: dict[str, torch.Tensor], op: Op) -> dict[str, torch.Tensor]:
        """``all_reduce`` of every tensor of a name-keyed table, in one collective per dtype.
        The ranks must hold the same names, shapes and dtypes (checked: a difference is a
        :class:`DistributedError`, not a silent mix-up)."""
        import torch

        if not self.distributed:
            return tensors
        names = sorted(tensors)
        signature = [(n, tuple(tensors[n].shape), str(tensors[n].dtype)) for n in names]
        others = self.all_gather_object(signature)
        for rank, theirs in enumerate(others):
            if theirs != signature:
                differing = sorted(set(map(str, theirs)) ^ set(map(str, signature)))
                raise DistributedError(f"rank {rank} holds other tensors than rank {self.rank}, e.g. {differing[:3]}")
        out: dict[str, torch.Tensor] = {}
        for dtype in sorted({t.dtype for t in tensors.values()}, key=str):
            group = [n for n in names if tensors[n].dtype == dtype]
            flat = torch.cat([tensors[n].detach().reshape(-1).cpu() for n in group])
            reduced = self.all_reduce(flat, op)
            for name, part in zip(group, reduced.split([tensors[n].numel() for n in group])):
                out[name] = part.reshape(tensors[name].shape).to(tensors[name].device)
        return {name: out[name] for name in tensors}

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, source: int = 0) -> Any:
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=source)
        return box[0]

    def barrier(self) -> None:
        import torch

        if self.distributed:
            import torch.distributed as dist

            dist.barrier(device_ids=[torch.cuda.current_device()]) if self.backend == "nccl" else dist.barrier()

    # -- failing together ------------------------------------------------------------------------
    def agree(self, ok: bool, step: str) -> None:
        """An agreement point: every rank says whether its part of ``step`` succeeded. On a rank
        that succeeded while another failed, raises :class:`DistributedError` (the failing rank
        raises its own error after calling this with ``ok=False``)."""
        if not self.distributed:
            return
        failed = self.all_gather_object(None if ok else self.rank)
        others = [rank for rank in failed if rank is not None and rank != self.rank]
        if ok and others:
            error = DistributedError(f"rank {others[0]} failed during {step}; this rank ({self.rank}) stopped with it (that rank's error says why)")
            error.reported_to_ranks = True  # the others know already: telling them again would wait forever
            raise error

    def fail(self, step: str) -> None:
        """Call from an ``except`` block: tells the other ranks that this one failed (best effort;
        the caller re-raises its own error). Once per error: an error the ranks already agreed
        on (raised by :meth:`agree`, or reported by an inner ``fail``) is not reported again."""
        if not self.distributed:
            return
        error = sys.exc_info()[1]
        if error is not None and getattr(error, "reported_to_ranks", False):
            return
        try:
            self.agree(False, step)
        except Exception:  # the group itself may be what broke; the caller's error matters
            pass
        if error is not None:
            try:
                error.reported_to_ranks = True  # type: ignore[attr-defined]
            except AttributeError:  # an exception type without a __dict__
                pass

    def on_main(self, work: Callable[[], T], step: str) -> T:
        """``work()`` on rank 0 alone (writing a file), then every rank gets its result."""
        if not self.distributed:
            return work()
        result: Any = None
        if self.is_main:
            try:
                result = work()
            except BaseException:
                self.fail(step)
                raise
        self.agree(True, step)
        return self.broadcast_object(result)


SINGLE = Ranks()
_current: Ranks | None = None


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise DistributedError(f"the launcher set WORLD_SIZE but not {name}: start the run with torchrun (docs/distributed.md)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not an integer") from None


def launched() -> bool:
    """Whether a launcher started several processes (``WORLD_SIZE`` > 1)."""
    return _env_int("WORLD_SIZE", 1) > 1


def speaks() -> bool:
    """Whether this process prints: under a launcher only rank 0 writes tables, JSON and progress
    (every rank still prints its own errors). Needs no torch and forms no group."""
    return not launched() or os.environ.get("RANK", "0") == "0"


def _backend() -> str:
    import torch

    chosen = os.environ.get(BACKEND_ENV) or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen not in BACKENDS:
        raise DistributedError(f"{BACKEND_ENV}={chosen!r}: choose one of {', '.join(BACKENDS)}")
    if chosen == "nccl" and not torch.cuda.is_available():
        raise DistributedError("the nccl backend needs CUDA, which this process does not see; use gloo for CPU ranks")
    return chosen


def current() -> Ranks:
    """This process's :class:`Ranks`; forms the process group on first use under a launcher."""
    import torch

    global _current
    if _current is not None:
        return _current
    if not launched():  # not cached: a forked child may be launched where its parent was not
        return SINGLE
    import torch.distributed as dist

    world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world_size:
        raise DistributedError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    if dist.is_initialized():  # the caller's own script formed the group: join it as it is
        _current = Ranks(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend())
        return _current
    if not os.environ.get("MASTER_ADDR"):
        raise DistributedError("the launcher set WORLD_SIZE but not MASTER_ADDR: start the run with torchrun (docs/distributed.md)")
    _env_int("MASTER_PORT")
    backend = _backend()
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: start at most one rank per GPU")
        torch.cuda.set_device(local_rank)
    try:
        dist.init_process_group(backend=backend, init_method="env://", world_size=world_size, rank=rank)
    except Fp4forgeError:
        raise
    except Exception as exc:  # rendezvous refused, timed out, address in use
        raise DistributedError(f"the process group did not form ({backend}, rank {rank} of {world_size}): {exc}") from exc
    _current = Ranks(rank, world_size, local_rank, backend)
    atexit.register(shutdown)
    return _current


def shutdown() -> None:
    """Tear the process group down (registered at exit; safe to call twice)."""
    global _current
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and _current is not None and _current.distributed:
        try:
            dist.destroy_process_group()
        except Exception:  # at exit, a peer may already be gone: nothing left to tell it
            pass
    _current = None
