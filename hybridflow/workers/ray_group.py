"""Worker groups of Ray actors: the one module that imports Ray.

Each rank is a Ray actor process in a placement group bundle (one device, or one CPU on a CPU-only run).
It joins its group's own ``torch.distributed`` world (gloo on CPU, NCCL on GPU, ``trainer.nccl_timeout``),
builds its roles from the config and waits for calls. The driver waits on every rank's result at once, so a
rank that raises or dies is reported at once (role, rank and the remote traceback), never as a hang in a
collective the other ranks are stuck in.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from hybridflow.config.schema import Config
from hybridflow.utils.errors import UserError
from hybridflow.utils.threads import PASSIVE_WAIT, configure_cpu_threads, passive_wait_env
from hybridflow.workers.dispatch import DataLayout
from hybridflow.workers.group import WorkerError, WorkerGroup

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the driver looks at pending results; a dead rank is noticed within this
DEATH_GRACE_S = 10.0  # after a rank fails, how long to look for a dead rank that caused it


def import_ray() -> Any:
    """The ray module, or a ValueError with the install hint."""
    try:
        import ray
    except ImportError as e:
        raise UserError("trainer.backend=ray needs Ray: pip install 'hybridflow[ray]'") from e
    return ray


def ensure_ray(address: str | None, min_cpus: int = 1) -> Any:
    """Join the cluster at ``address`` or start a local Ray instance (once per driver process).

    A local instance offers at least ``min_cpus`` CPU slots even on a smaller machine: on a CPU-only run
    each rank takes one, and the ranks of colocated and split groups then share the cores.
    """
    ray = import_ray()
    if not ray.is_initialized():
        # Ranks wait passively, as the driver does (or keep the wait policy the user set for the driver).
        waits = {k: os.environ[k] for k in PASSIVE_WAIT if k in os.environ}
        passive_wait_env(waits)
        env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **waits}}
        cpus = None if address else max(os.cpu_count() or 1, min_cpus)
        ray.init(address=address, num_cpus=cpus, runtime_env=env, log_to_driver=True, include_dashboard=False)
        logger.info("Ray: %s", "joined " + address if address else "started a local instance")
    return ray


@dataclass
class Pending:
    """Calls submitted to a group's ranks and not yet collected: Ray object references by rank."""

    refs: dict[int, Any]
    what: str


class RankProcess:
    """The body of one Ray actor: a process-group member holding a ``RankWorker``."""

    def __init__(self, rank: int, world: int, group: str) -> None:
        self.rank, self.world, self.group = rank, world, group
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port (rank 0 hosts the rendezvous)."""
        from hybridflow.utils.dist import free_port

        ray = import_ray()
        return ray.util.get_node_ip_address(), free_port()

    def setup(
        self,
        cfg: Config,
        total_steps: int,
        roles: tuple[str, ...],
        master: tuple[str, int],
        supervised: bool = False,
    ) -> tuple[int, list[str]]:
        """Join the group's process group and build the roles (``supervised``: for SFT,
        ``build_rank_worker``); returns the process id and the roles held."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK="0",  # Ray gives each actor exactly its own device(s): index 0 of the visible ones
            LOCAL_WORLD_SIZE=str(cfg.trainer.n_gpus_per_node),  # at most this many ranks share the host
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        from hybridflow.utils.device import cap_gpu_memory, cuda_in_use, use_device_type
        from hybridflow.utils.dist import init_distributed
        from hybridflow.utils.logging import setup_console_logging
        from hybridflow.workers.build import build_rank_worker

        setup_console_logging("INFO" if self.rank == 0 else "WARNING")
        use_device_type(cfg.trainer.device)
        configure_cpu_threads(cfg.trainer.cpu_threads, on_cpu=not cuda_in_use())
        cap_gpu_memory(cfg.trainer.gpu_memory_gb)
        init_distributed(timeout_s=cfg.trainer.nccl_timeout)
        self.worker = build_rank_worker(cfg, total_steps, roles, self.group, supervised)
        return os.getpid(), list(self.worker.roles)

    def run(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Call a ``RankWorker`` method."""
        return getattr(self.worker, method)(*args, **kwargs)

    def run_share(self, role: str, method: str, share: Any, source: bool, args: tuple) -> Any:
        """``RankWorker.call_share``; ``share`` comes as an object reference, which Ray resolves here."""
        return self.worker.call_share(role, method, share, source, *args)


class RayGroup(WorkerGroup):
    """``world`` Ray actors with ``roles``, placed one per bundle of their own placement group
    (``supervised``: the ranks of an SFT run, ``build_rank_worker``)."""

    def __init__(
        self,
        cfg: Config,
        total_steps: int,
        roles: tuple[str, ...],
        name: str,
        world: int,
        use_gpu: bool,
        supervised: bool = False,
    ) -> None:
        ray = ensure_ray(cfg.trainer.ray_address)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__()
        self.ray, self.name, self.world, self.roles, self.use_gpu = ray, name, world, roles, use_gpu
        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        self.pg = placement_group([bundle] * world, strategy="PACK")
        ray.get(self.pg.ready(), timeout=cfg.trainer.nccl_timeout)
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if use_gpu else 0, max_restarts=0)(RankProcess)
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                name=f"hybridflow-{name}-{r}-{os.getpid()}",
            ).remote(r, world, name)
            for r in range(world)
        ]
        master = ray.get(self.actors[0].address.remote())
        self.held = roles  # until the ranks say which of the roles the config enables
        setup = self._wait(
            {
                r: a.setup.remote(cfg, total_steps, roles, master, supervised)
                for r, a in enumerate(self.actors)
            },
            "setup",
        )
        self.pids = [pid for pid, _ in setup]
        self.held = tuple(setup[0][1])
        logger.info(
            "worker group %s: %d rank(s) holding %s (pids %s)",
            name,
            world,
            ", ".join(self.held),
            ", ".join(map(str, self.pids)),
        )

    def _describe(self, rank: int) -> str:
        return f"rank {rank} of worker group '{self.name}' (roles: {', '.join(self.held)})"

    def _wait(self, refs: dict[int, Any], method: str) -> list[Any]:
        """Every rank's result; the first failure (an exception or a dead process) stops the whole group."""
        ray = self.ray
        pending = {ref: rank for rank, ref in refs.items()}
        results: dict[int, Any] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, UserError):  # a full disk, a bad file: one line and exit 2
                        logger.debug("%s raised a user error in %s", self._describe(rank), method)
                        self.shutdown()
                        raise e.cause from None
                    message = self._failure(rank, e, pending, method)
                    self.shutdown()
                    raise WorkerError(message) from None
                except ray.exceptions.RayActorError as e:
                    message = self._failure(rank, e, pending, method)
                    self.shutdown()
                    raise WorkerError(message) from None
        return [results.get(r) for r in range(self.world)]

    def _failure(self, rank: int, error: Exception, pending: dict[Any, int], method: str) -> str:
        """Name the rank that caused a failure: a dead rank often shows first as a survivor's broken collective."""
        ray = self.ray
        if isinstance(error, ray.exceptions.RayActorError):
            return f"{self._describe(rank)} died during {method}: its process exited ({type(error).__name__})"
        ready, _ = (
            ray.wait(list(pending), num_returns=len(pending), timeout=DEATH_GRACE_S) if pending else ([], [])
        )
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                return (
                    f"{self._describe(pending[ref])} died during {method}: its process exited; "
                    f"{self._describe(rank)} then failed:\n{error}"
                )
            except ray.exceptions.RayTaskError:
                continue
        return f"{self._describe(rank)} raised in {method}:\n{error}"

    def run_each(self, method: str, per_rank_args: list[tuple], **kwargs: Any) -> list[Any]:
        """Call ``RankWorker.method`` on the ranks that have arguments; results in rank order."""
        return self.collect(self.submit_each(method, per_rank_args, **kwargs))

    def submit_each(self, method: str, per_rank_args: list[tuple], **kwargs: Any) -> Pending:
        """``run_each`` without waiting: the calls, to ``collect`` later (a rank runs its calls in order)."""
        refs = {
            r: actor.run.remote(method, args, kwargs)
            for r, (actor, args) in enumerate(zip(self.actors, per_rank_args))
            if args is not None
        }
        first = next(a for a in per_rank_args if a is not None)
        return Pending(refs, f"{first[0]}.{first[1]}" if method == "call" else method)

    def collect(self, pending: Pending) -> list[Any]:
        """The results of submitted calls, in rank order (None for a rank without a call)."""
        return self._wait(pending.refs, pending.what)

    def call_shares(
        self, role: str, method: str, shares: list[Any], layout: DataLayout, *args: Any
    ) -> list[Any]:
        """Each share goes into the object store once and the ranks of its replica all read that copy."""
        return self.collect(self.submit_shares(role, method, shares, layout, *args))

    def submit_shares(
        self, role: str, method: str, shares: list[Any], layout: DataLayout, *args: Any
    ) -> Pending:
        """``call_shares`` without waiting."""
        refs = [self.ray.put(share) for share in shares]
        calls = {}
        for r, actor in enumerate(self.actors):
            replica = layout.replica_of[r]
            source = layout.sources[replica] == r
            calls[r] = actor.run_share.remote(role, method, refs[replica], source, args)
        return Pending(calls, f"{role}.{method}")

    def address(self) -> tuple[str, int]:
        """The node of rank 0 and a free port there (a rendezvous another group can join)."""
        return self.ray.get(self.actors[0].address.remote())

    def barrier(self) -> None:
        """The driver is one process: nothing to line up."""

    def shutdown(self) -> None:
        """Kill the group's actors and free its placement group."""
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        try:
            self.ray.util.remove_placement_group(self.pg)
        except Exception:  # already gone with the cluster
            logger.debug("placement group of %s already removed", self.name)
