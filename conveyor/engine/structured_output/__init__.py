"""Structured outputs: grammar-constrained decoding (the seed's bitmask stage).

Importing this package loads no grammar backend; backends load on first use.
"""
from conveyor.engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
