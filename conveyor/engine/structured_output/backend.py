"""What a grammar backend is (the registry that builds one: registry.py).

A backend turns StructuredOutputsParams into a Grammar: a matcher that is fed
the request's accepted tokens; the backend fills the rows of a packed int32
bitmask for a batch of grammars (bit j of word i allows token 32*i + j). Backends are built once per engine
from the tokenizer directory and the model's vocab size; bits for ids the
tokenizer does not know are always 0.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from conveyor.engine.structured_output.params import StructuredOutputsParams


class Grammar(Protocol):
    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance by tokens the engine accepted; False if one is not allowed."""

    def is_terminated(self) -> bool:
        """The output is complete: no further token is allowed."""

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar accepts from here (state unchanged)."""


# A backend fills masks only for the grammars it compiled (its own matcher type).
G = TypeVar("G", bound=Grammar)


class StructuredOutputBackend(Protocol[G]):
    def compile(self, params: StructuredOutputsParams) -> G:
        """Build a matcher; raises ValueError for an invalid or unsupported spec."""

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError (naming the problem) if compile() would fail."""

    def fill_bitmasks(self, grammars: list[G], bitmask: np.ndarray,
                      drafts: list[list[int]] | None = None) -> None:
        """Fill bitmask[i] for grammars[i] (C-contiguous int32 [n, words]).
        With drafts (each a prefix the grammar accepts), grammars[i] owns
        len(drafts[i]) + 1 consecutive rows: row j is its mask after drafts[i][:j];
        the matchers end where they started."""


# (tokenizer_dir, vocab_size, eos_token_id, allow_additional_properties)
BackendFactory = Callable[[str, int, "int | None", bool], "StructuredOutputBackend[Any]"]
