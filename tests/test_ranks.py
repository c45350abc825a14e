"""Ranks agreeing on which steps failed on any of them, over a real gloo group of processes that
talk on loopback (:mod:`kvflow.ranks`)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import torch

from kvflow.ranks import failed_on_any

# each rank: the steps that failed on it, and the steps it asks about, in order
FAILED_HERE = ({5}, {7, 9}, set())
ASKED = ([4, 5, 7], [4], [2, 9, 11])


def _rank(rank: int, size: int, rendezvous: str, results: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk on loopback only
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size
    )
    try:
        group = torch.distributed.new_group(list(range(size)), backend="gloo")
        answers = [sorted(failed_on_any(steps, FAILED_HERE[rank], group)) for steps in ASKED]
        results.put((rank, answers))
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_learns_the_steps_that_failed_on_any_rank(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")  # (a fork of a process with threads may hang)
    results = context.Queue()
    size = len(FAILED_HERE)
    ranks = [
        context.Process(target=_rank, args=(rank, size, str(tmp_path / "rendezvous"), results))
        for rank in range(size)
    ]
    for process in ranks:
        process.start()
    try:
        answers = dict(results.get(timeout=120) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in ranks] == [0] * size
    # a step failed on any rank counts as failed on every rank; one failed on none on no rank
    assert answers == {rank: [[5, 7], [], [9]] for rank in range(size)}
