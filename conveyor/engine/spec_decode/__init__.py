"""Speculative decoding, core side: the n-gram proposer and its counters."""
from conveyor.engine.spec_decode.metrics import SpecDecodeCounters
from conveyor.engine.spec_decode.ngram import NgramProposer, find_ngram_draft

__all__ = ["NgramProposer", "SpecDecodeCounters", "find_ngram_draft"]
