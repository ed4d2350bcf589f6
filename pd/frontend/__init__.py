"""What the HTTP handlers share: the coordinator (tokenizer, ranks, metrics, lifecycle), the engine
requests behind one HTTP request (generation), rank routing and the server's metrics."""
