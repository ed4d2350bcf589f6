"""HTTP plumbing every port shares: reading bodies and writing JSON (io), the listening site (TLS,
connection cap, timeouts), request ids in logs. Knows nothing of the API or the engine."""
