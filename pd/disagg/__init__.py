"""The disaggregated path on the decode side: the decode coordinator's path for one request
(decode_path), its prefill engines (prefill_pool, prefill_client), the cluster's /prefill
authentication and the P/D metrics."""
