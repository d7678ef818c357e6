"""Multimodal inputs at the edge: image URLs fetched and decoded under a
policy, content hashes (docs/multimodal.md is to come with the encoder stage)."""
