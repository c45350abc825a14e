"""Command-line programs: the demo, the benchmark and their shared helpers."""
