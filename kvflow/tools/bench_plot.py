"""``kvflow bench --plot FILE``: throughput against object size, beside memcpy, as a PNG.

matplotlib is an optional extra (``pip install 'kvflow[plot]'``); without it the command says so
before it measures anything.
"""

from __future__ import annotations

from typing import Any

from kvflow.errors import MissingDependencyError

__all__ = ["check_plotting", "plot_throughput"]


def check_plotting() -> None:
    """Raise MissingDependencyError, saying what to install, when matplotlib is not there."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "matplotlib", "kvflow bench --plot", "pip install 'kvflow[plot]'"
        ) from None


def plot_throughput(result: dict[str, Any], path: str) -> None:
    """Store, retrieve and memcpy GB/s against object size (the largest batch of each size)."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[float, dict[str, Any]] = {}
    for row in result["store_retrieve"]:
        if row["object_kib"] not in rows or row["batch"] > rows[row["object_kib"]]["batch"]:
            rows[row["object_kib"]] = row
    sizes = sorted(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (
        ("memcpy_gbps", "memcpy", "k--"),
        ("store_gbps", "store", "o-"),
        ("retrieve_gbps", "retrieve", "s-"),
    ):
        ax.plot(sizes, [rows[s][key] for s in sizes], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{s:.0f} KiB" if s < 1024 else f"{s / 1024:.0f} MiB" for s in sizes])
    ax.set_xlabel("object size")
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvflow over {result['backend']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
