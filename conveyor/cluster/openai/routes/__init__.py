"""Endpoints beyond generation: admin (drain), LoRA adapters, utilities
(/tokenize, /detokenize, /v1/models/{id})."""
