"""The engine rank: its process (worker, one per GPU, `python -m pd.rank.worker`), the server's handle on
it (client), and the P/D roles a rank takes (role, prefill_role, decode_role) with their threads."""
