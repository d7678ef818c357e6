"""Structured outputs: grammar-constrained decoding (the seed's bitmask stage).

Importing this package loads no grammar backend; backends load on first use.
"""
from engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
