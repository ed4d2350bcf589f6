"""Speculative decoding (`--speculative-config`, engine/config.py SpeculativeConfig): a proposer drafts up to
k tokens per decoding sequence, one forward verifies them all (each sequence's last token and its drafts
as one chunk), and the engine keeps the longest run of drafts the target itself would have drawn, plus
the target's own next token. The lossless rule and the bookkeeping live in `speculator.py`; the
proposers: `ngram.py` (prompt lookup), `mtp.py` (the checkpoint's multi-token-prediction layers),
`draft_model.py` (a small model of the same tokenizer); `setup.py`, what the engine builds for it at start."""
