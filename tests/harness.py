"""Run a function on N local ranks (one process each; gloo, or NCCL on CUDA) and collect what each returns."""

import os
import queue as queue_module
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, fn, args, queue, backend: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        queue.put((rank, "ok", fn(*args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout_s: float = 600.0, backend: str = "gloo") -> list:
    """``fn(*args)`` on ``world`` ranks; returns the per-rank results in rank order and raises
    with the first failing rank's traceback, as soon as a rank dies without one (a crash in
    native code), or when ``timeout_s`` passes without every answer. The ranks meet at a store
    this process holds on a port the system picks, as torchrun's agent does, so that ranks of
    tests running beside these never take its port."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, backend)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world and not errors:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [
                    f"rank {r} died with exit code {p.exitcode} before reporting"
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results
                ]
                if dead or time.monotonic() > deadline:
                    errors.extend(
                        dead
                        or [f"no answer from ranks {sorted(set(range(world)) - set(results))} in {timeout_s:.0f} s"]
                    )
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
