"""Benchmarks in one process, no server: each times one piece (a kernel, the handoff, detokenizing, a
grammar backend, the prefix cache's copies, the engine's decode and prefill) against a ceiling measured
in the same run. engine_speed.py holds the ceilings and timers the others share."""
