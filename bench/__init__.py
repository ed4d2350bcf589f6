"""Checks, benchmarks and load tools (the top layer: they may import every other package).

Run as scripts (`python bench/load/replay.py ...`) or imported as `bench.<module>` (tests do); each script
puts the repository root on its path when the project is not installed (the GPU machine)."""
