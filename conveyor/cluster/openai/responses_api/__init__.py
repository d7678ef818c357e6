"""`/v1/responses`: its models (protocol.py), routes (routes.py) and the store
of finished responses (store.py)."""
