"""bench/load/replay.py's parts: the trace (`trace`), one run against an endpoint (`runner`), a run's numbers
(`summary`), its tables and results.json (`report`), its PNGs (`plots`), and the command-line flags it
shares with bench/load/compare.py (`cli`)."""
