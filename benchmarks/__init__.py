"""Benchmark scripts, importable as `benchmarks.<name>` from the repository root (tests import them so).

Each script also runs as a file from a checkout (`python3 benchmarks/<name>.py`); docs/benchmarks.md says
what each measures and holds the current figures.
"""
