"""`pdserve router`: a stateless HTTP front over the CEs (pd/router/server.py)."""
