"""Checks, benchmarks and load tools (the top layer: they may import every other package).

    micro/    benchmarks in one process, no server: kernels, the handoff, detokenizing, grammars, the
              prefix cache and the engine's decode and prefill speed, each against its ceiling
    checks/   correctness on the GPU (golden tokens, determinism, bf16 error, device-side features) and
              an offline compile of the Triton kernels
    load/     load against running endpoints: the multi-turn replay (`pdserve bench load`), target
              comparisons (`pdserve bench compare`), aiperf pairing, the soak test
    device/   one-device-call scripts: the tests and timings of one piece of work in a single GPU run
    configs/  the 8B-shaped and MoE model configs the benchmarks use (JSON)

At the top stay the commands of the design card: check_pd.py (token identity, single engine vs P/D),
check_prefix_cache.py (A/B of the prefix cache) and nccl_xtray_test.py (NCCL's transport between hosts),
and speed_guard.py (this tree's key engine rows against a baseline commit's in one GPU call; a
slowdown's bisection over commits).
Current figures: RESULTS.md (the index of figures/, one page per topic); how they were reached:
RESULTS-log-2026-12.md.

Run as scripts (`python bench/load/replay.py ...`) or imported as `bench.<folder>.<module>` (tests do);
each script puts the repository root on its path when the project is not installed (the GPU machine)."""
