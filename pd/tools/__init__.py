"""What runs beside the server: the `pdserve` command, `make demo`'s client, and a real server in a
child process for tests and benchmarks (server_process)."""
