"""The disaggregated path on the decode side (the CE): one request's path (decode_path: reserve decode
memory, ask a prefill engine, decode what it sends), the prefill engines it asks (prefill_pool,
prefill_client), the cluster's /prefill authentication and the P/D metrics."""
