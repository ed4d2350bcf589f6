"""KV cache events off the engine ranks: vLLM's wire format (wire.py), a rank's ZeroMQ publisher with its
replay socket (publisher.py), and the cluster's prefix index that routers read (index.py)."""
