"""The engine's bookkeeping and memory: what a sequence is, where its KV lives, what runs next.

    sequence.py           a request's state inside the engine (tokens, computed length, pages, slot)
    scheduler.py          the waiting and running queues: admission, chunked prefill, preemption
    block_pool.py         refcounted pools of KV pages and SWA state slots
    kv_cache.py           the KV tensors (paged pool, SWA state slots) over a KVLayout
    prefix_cache.py       the hash-chain index of the host prefix cache (ints and lists, no tensors)
    host_prefix_cache.py  the host prefix cache's pinned pool and its copies in and out
    decode_cache.py       a CE's finished pages kept as evictable cache (the delta handoff's other half)
    detokenizer.py        incremental detokenization with stop strings
    grammar.py            structured outputs: a request's constraint and its token masks
    prompt_logprobs.py    a sequence's prompt logprobs gathered as its prefill runs

Nothing here imports a model, a layer or a kernel: the bookkeeping runs and is tested on the CPU.
"""
