"""A tiny byte-level BPE tokenizer trained on the spot (tests never download).

The code lives in conveyor/cluster/demo/model.py (the demo checkpoint of `make run`
uses it too): one copy, re-exported here under the names tests import.
Special token ids are fixed: <s>=0 (bos), </s>=1 (eos), <unk>=2, <pad>=3.
"""
from __future__ import annotations

from conveyor.cluster.demo.model import (
                                BOS,
                                CHAT_TEMPLATE,
                                EOS,
                                PAD,
                                SPECIAL_TOKENS,
                                UNK,
                                build_tiny_tokenizer,
                                tiny_corpus,
                                train_tiny_tokenizer,
)

__all__ = ["BOS", "EOS", "UNK", "PAD", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "tiny_corpus",
           "build_tiny_tokenizer", "train_tiny_tokenizer"]
