"""Load against running OpenAI-compatible endpoints: replay.py (multi-turn traces, `pdserve bench load`),
compare.py (several targets on one trace, `pdserve bench compare`), cluster_compare.sh (PE routing in a
P/D cluster), aiperf_vs_load.py (replay.py and aiperf on the same trace, request by request), soak.py
(faults for minutes, then nothing lost); loadgen/ holds their shared parts."""
