"""What a load's copy would gain on more cores: one copy of a prompt's KV, by the copy loop kvflow
uses (one thread) beside torch's copy on one thread and on all of its threads.

    python benchmarks/copy_threads.py [--mib 32] [--repeat 20] [--json]

A sync engine waits for its load: the copy runs on kvflow's loop thread while the engine's other
cores sit idle. kvflow starts no threads of its own (docs/architecture.md), so its copy takes one
core; this measures what that costs beside a copy that takes them all, in the same run. Each copy
moves ``--mib`` MiB between two pre-faulted buffers, best of ``--repeat``; the copies are checked
once against the source.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from kvflow.regions import copy_rows
from kvflow.tools.baselines import best_s


def measure(mib: int, repeat: int) -> dict[str, float]:
    src = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    starts = np.asarray([dst.data_ptr()], dtype=np.int64)
    rows = np.asarray([[src.data_ptr()]], dtype=np.int64)
    sizes = np.asarray([src.numel()], dtype=np.int64)
    threads = torch.get_num_threads()
    loop_s = best_s(lambda: copy_rows(starts, rows, sizes, into_regions=False), repeat)
    if not torch.equal(src, dst):
        raise RuntimeError("the copy loop copied other bytes")
    dst.zero_()
    try:
        torch.set_num_threads(1)
        one_s = best_s(lambda: dst.copy_(src), repeat)
        torch.set_num_threads(threads)
        all_s = best_s(lambda: dst.copy_(src), repeat)
    finally:
        torch.set_num_threads(threads)
    if not torch.equal(src, dst):
        raise RuntimeError("torch's copy copied other bytes")
    return {
        "mib": mib,
        "threads": threads,
        "copy_loop_ms": loop_s * 1e3,
        "torch_one_thread_ms": one_s * 1e3,
        "torch_all_threads_ms": all_s * 1e3,
        "all_threads_vs_copy_loop": loop_s / all_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    row = measure(args.mib, args.repeat)
    if args.json:
        print(json.dumps(row))
        return
    print(
        f"{row['mib']} MiB: copy loop {row['copy_loop_ms']:.2f} ms, torch on 1 thread "
        f"{row['torch_one_thread_ms']:.2f} ms, on {row['threads']} threads "
        f"{row['torch_all_threads_ms']:.2f} ms "
        f"({row['all_threads_vs_copy_loop']:.2f}x the copy loop's speed)"
    )


if __name__ == "__main__":
    main()
