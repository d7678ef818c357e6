"""KV connectors: KV that lives outside the engine's paged pool (the seed's
connector contract). The scheduler side is here (no torch); the worker side
is conveyor/workers/kv_connector/. docs/kv_tiers.md describes the tiers."""
