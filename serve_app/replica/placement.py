"""Where an engine replica runs: its placement-group bundles, and the GPUs its TP ranks may use.

One replica = one placement group. On CUDA: one {"GPU": 1} bundle per tensor-parallel rank,
STRICT_PACK (all ranks on one node: NCCL over NVLink/PCIe, never across hosts); the replica
actor itself lives in bundle 0 and spawns ranks 1.. as local processes. On CPU: one CPU
bundle per rank (gloo), also packed.
"""
from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs


def resolve_device(device: str) -> str:
    """Where replicas go: 'auto' is 'cuda' when the Ray cluster has GPUs, else 'cpu' (decided
    where the app is built, from cluster resources). Not the engine's device rule: each
    replica's engine resolves its own config in `EngineConfig.resolve` (engine/config/engine.py)."""
    if device != "auto":
        return device
    try:
        import ray
        if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0:
            return "cuda"
    except Exception:  # noqa: BLE001 - no cluster to ask: serve on CPU
        logger.debug("could not read cluster resources; device auto -> cpu")
    return "cpu"


def check_gpus(device: str, tensor_parallel_size: int) -> None:
    """device='cuda': refuse, where the app is built, a replica that no node of this machine's
    cluster can place; Serve would wait for its GPU bundles (one per TP rank, all on one node)
    forever. ValueError naming the value. On a cluster of other machines (KubeRay) a GPU node
    may still come (an autoscaler, a pod being scheduled): there it is a warning."""
    if device != "cuda":
        return
    most, where, certain = max_gpus_per_node()
    if most is None or most >= tensor_parallel_size:
        return
    problem = (f"device='cuda' needs {tensor_parallel_size} GPU(s) on one node "
               f"(tensor_parallel_size={tensor_parallel_size}), but {where}")
    if certain:
        raise ValueError(f"{problem}: serve with device='cpu' (or 'auto'), or on a GPU machine")
    logger.warning("%s: the engine replicas wait until such a node joins the cluster", problem)


def max_gpus_per_node() -> tuple[float | None, str, bool]:
    """The most GPUs one node has, where that was read, and whether no other node can join: true
    for a cluster on this machine only (`serve run` starts one after building the app; a process
    that started Ray itself, as `rayllm serve` and tests do). None: not known from here."""
    import ray

    if ray.is_initialized():
        most = max((n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=0.0)
        where = "the Ray cluster has no GPU" if most == 0 else f"no node of the Ray cluster has more than {most:g}"
        return most, where, _started_ray_here()
    if os.environ.get("RAY_ADDRESS"):  # `serve run` will join a cluster elsewhere
        return None, "", False
    import torch  # `serve run` starts its cluster on this machine, with the GPUs torch sees here

    count = torch.cuda.device_count()
    return float(count), "this machine has no GPU" if count == 0 else f"this machine has {count}", True


def _started_ray_here() -> bool:
    """Whether this process started its Ray cluster (ray.init() with no address): one node, this
    machine, no autoscaler. A process in a cluster (the Serve controller building a config's app)
    or connected to one is not."""
    try:
        from ray._private import worker

        node = worker._global_node
        return node is not None and node.head  # a connected process (driver or worker) has head=False
    except Exception:  # noqa: BLE001 - another Ray layout: not known
        return False


def engine_placement(device: str, tensor_parallel_size: int, num_cpus: float) -> dict[str, Any]:
    """`ray_actor_options` + `placement_group_bundles` + strategy for one EngineDeployment replica."""
    if device == "cuda":
        bundles = [{"CPU": num_cpus, "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(tensor_parallel_size - 1)]
        actor = {"num_cpus": num_cpus, "num_gpus": 1.0}
    else:
        bundles = [{"CPU": num_cpus}] + [{"CPU": 1.0} for _ in range(tensor_parallel_size - 1)]
        actor = {"num_cpus": num_cpus}
    return {"ray_actor_options": actor, "placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}


def use_cpu_threads(num_threads: int | None, tensor_parallel_size: int) -> int:
    """Give a CPU engine replica's torch the cores it is meant to use; returns threads per rank.

    Ray exports OMP_NUM_THREADS = the actor's num_cpus (1 by default) into every worker, a
    scheduling reservation that would otherwise become the engine's compute width. The
    replica's TP ranks are spawned processes: they read OMP_NUM_THREADS, so it is set too.
    """
    import torch

    total = num_threads or len(os.sched_getaffinity(0))
    per_rank = max(1, total // tensor_parallel_size)
    os.environ["OMP_NUM_THREADS"] = str(per_rank)
    torch.set_num_threads(per_rank)
    logger.info("CPU engine: %d torch threads per rank", per_rank)
    return per_rank


def expose_bundle_gpus(tensor_parallel_size: int) -> None:
    """Make the GPUs of all of this replica's bundles visible to its TP worker processes.

    Ray sets CUDA_VISIBLE_DEVICES of the replica to bundle 0's GPU only. Each other bundle's
    GPU id is learned by a zero-work task scheduled into that bundle; rank r then uses the
    r-th visible device. Must run before torch initialises CUDA in this process.
    """
    if tensor_parallel_size <= 1:
        return
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is None:
        raise RuntimeError("tensor_parallel_size > 1 needs the replica's placement group (none found)")

    @ray.remote(num_gpus=1, num_cpus=0)
    def _gpu_ids() -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]

    own = [str(g) for g in ray.get_gpu_ids()]
    refs = [_gpu_ids.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
            .remote() for i in range(1, tensor_parallel_size)]
    others = [g for ids in ray.get(refs) for g in ids]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(own + others)
    logger.info("tensor parallel over GPUs %s", os.environ["CUDA_VISIBLE_DEVICES"])
