"""Shared setup of the distributed tests (test_distributed.py, test_fsdp.py): 2 processes, gloo on CPU in CI;
AMPDOCTOR_TEST_BACKEND=nccl runs the same tests on two GPUs (recorded in benchmarks/RESULTS.md)."""
from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
BACKEND = os.environ.get("AMPDOCTOR_TEST_BACKEND", "gloo")
DEV = "cuda" if BACKEND == "nccl" else "cpu"


def available() -> bool:
    return dist.is_available() and dist.is_backend_available(BACKEND) and (
        DEV == "cpu" or torch.cuda.device_count() >= WORLD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process_group(rank: int, port: int):
    """Join the group; yields this rank's device; leaves the group however the body ends."""
    dist.init_process_group(BACKEND, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        dev = torch.device(DEV, rank) if DEV == "cuda" else torch.device("cpu")
        if DEV == "cuda":
            torch.cuda.set_device(dev)
        yield dev
    finally:
        dist.destroy_process_group()


def run(worker, tmp_path, case: str) -> str:
    """Run `worker(rank, port, run_dir, case)` on WORLD processes; returns the shared run directory."""
    run_dir = str(tmp_path / case)
    os.makedirs(run_dir)
    mp.spawn(worker, args=(_free_port(), run_dir, case), nprocs=WORLD, join=True)
    return run_dir
