"""The data-parallel router: which of N engines serves each request.

Pure Python (no Ray, no torch): `events` is what an engine publishes (the
block hashes its own BlockPool stores and evicts, its load), `index` keeps
block hash -> engines from those streams, `policy` scores engines per request.
The frontend that drives N engines (conveyor/engine/dp/client.py offline, the serving
tier) feeds the index and asks `Router.route` for each request. Import the
submodules directly (conveyor.engine.contracts imports `events`; nothing here may pull
the rest in)."""
