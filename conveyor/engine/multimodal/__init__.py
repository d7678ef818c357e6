"""Multimodal inputs (docs/multimodal.md): image URLs fetched and decoded
under a policy with content hashes (media.py), the model's image processor
and placeholder expansion (inputs.py), chat parts (chat.py), the features a
request carries (features.py) and the scheduler's encoder cache
(encoder_cache.py)."""
