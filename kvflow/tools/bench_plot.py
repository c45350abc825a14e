"""``kvflow bench --plot FILE``: throughput against object size, beside memcpy, as a PNG.

matplotlib is an optional extra (``pip install 'kvflow[plot]'``); without it the command says so
before it measures anything, as it does for a file it could not write (:func:`check_plot_path`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError, MissingDependencyError

__all__ = ["check_plot_path", "check_plotting", "plot_throughput"]


def check_plotting() -> None:
    """Raise MissingDependencyError, saying what to install, when matplotlib is not there."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "matplotlib", "kvflow bench --plot", "pip install 'kvflow[plot]'"
        ) from None


def check_plot_path(path: str) -> None:
    """Before a run: MissingDependencyError without matplotlib; ConfigError when ``path`` cannot be
    written (its directory missing or not writable, a directory itself, a format matplotlib does
    not write), so that minutes of measuring are not lost at the end."""
    check_plotting()
    from matplotlib.backend_bases import FigureCanvasBase

    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise ConfigError(f"--plot {path} is a directory: name the image file, e.g. {target / 'bench.png'}")
    if not parent.is_dir():
        raise ConfigError(f"--plot {path}: there is no directory {parent}: create it, or pick another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"--plot {path}: no permission to write it: pick another path")
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = target.suffix[1:].lower()
    if suffix and suffix not in formats:
        known = ", ".join(sorted(formats))
        raise ConfigError(f"--plot {path}: matplotlib cannot write .{suffix} files: use .png (or {known})")


def plot_throughput(result: dict[str, Any], path: str) -> None:
    """Store, retrieve and memcpy GB/s against object size (the largest batch of each size); the
    memcpy drawn is both directions' baseline, the faster of memmove and the streamed copy.
    ConfigError when the file cannot be written (check :func:`check_plot_path` before the run)."""
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
        ("best_memcpy_gbps", "memcpy (the faster of memmove and streamed)", "k--"),
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
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(f"--plot {path}: could not write the plot: {exc}") from exc
    finally:
        plt.close(fig)
