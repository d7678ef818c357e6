"""The llguidance backend: JSON schema, regex, choice and Lark through one matcher.

JSON grammars are compact (no whitespace between tokens): a grammar that allows
unbounded whitespace lets a weak model loop inside a structure until max_tokens.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import llguidance as llg
import numpy as np

from conveyor.engine.structured_output.params import StructuredOutputsParams
from conveyor.engine.structured_output.schema import close_objects

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# Bounds on one grammar's lexer work, in llguidance's fuel units (~50k/ms to
# build the regex ASTs, ~14k/ms in a mask step). The defaults (1M, 200k) let a
# regex like a{100000} spend 50-700 ms of every engine step building lexer
# states, for every request on the step thread: this caps one matcher at about
# 1 ms a step, and the first (largest) build runs before the request is
# scheduled (validate at the edge, compile on the compile pool), where a
# grammar past it is refused naming the limit.
LEXER_LIMITS = {"initial_lexer_fuel": 50_000, "step_lexer_fuel": 20_000}
_ANY_JSON_OBJECT = {"type": "object"}


def _limits() -> llg.LLParserLimits:
    return llg.LLParserLimits(initial_lexer_fuel=LEXER_LIMITS["initial_lexer_fuel"],
                              step_lexer_fuel=LEXER_LIMITS["step_lexer_fuel"])


class LLGuidanceGrammar:
    __slots__ = ("matcher",)

    def __init__(self, matcher: llg.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, tokens: list[int]) -> bool:
        m = self.matcher
        for t in tokens:
            if m.is_stopped() or not m.consume_token(t):
                return False
        return True

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def error(self) -> str | None:
        """The matcher's error (a resource limit hit mid-generation), first line."""
        m = self.matcher
        return (m.get_error() or "error").splitlines()[0][:300] if m.is_error() else None

    def valid_prefix(self, tokens: list[int]) -> int:
        return self.matcher.validate_tokens(tokens)


class LLGuidanceBackend:
    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_id: int | None,
                 allow_additional_properties: bool = False) -> None:
        # False: schemas without additionalProperties admit no undeclared keys (schema.py).
        self.allow_additional_properties = allow_additional_properties
        path = os.path.join(tokenizer_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"structured outputs need a tokenizer: {path} not found")
        with open(path) as f:
            text = f.read()
        self.tokenizer = llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_token_id)
        self._words = (vocab_size + 31) // 32
        self._eos = eos_token_id
        self._executor: llg.LLExecutor | None = None  # drafts only; see fill_bitmasks

    def fill_bitmasks(self, grammars: list[LLGuidanceGrammar], bitmask: np.ndarray,
                      drafts: list[list[int]] | None = None) -> None:
        """bitmask[i] for grammars[i], or with drafts each grammar's row per
        draft position (llguidance advances the matcher through the drafts and
        rolls it back). A row after a draft that ends the grammar (EOS) is left
        as it was.

        Plain rows are computed matcher by matcher on the calling (step)
        thread: measured on the 2-core CPU bench (64 rows, vocab 512), the
        LLExecutor's pool threads made the mask 2.4x slower (37 against 15 µs
        a row) and the next forward slower too, its idle threads competing
        with torch's for the cores; the GIL is no cost here, as the step
        thread would only wait for the pool."""
        rows, words = bitmask.shape
        ptr, stride = bitmask.ctypes.data, words * 4
        if drafts is None:
            for i, g in enumerate(grammars):
                g.matcher.unsafe_compute_mask_ptr(ptr + i * stride, stride)
            return
        if self._executor is None:
            self._executor = llg.LLExecutor(num_threads=1)
        plain, drafted, row = [], [], 0
        for g, d in zip(grammars, drafts):
            # llguidance refuses an empty draft list: those rows go in a plain call.
            if d:
                drafted.append((g.matcher, row, d))
            else:
                plain.append((g.matcher, row))
            row += len(d) + 1
        for m, r in plain:
            m.unsafe_compute_mask_ptr(ptr + r * stride, stride)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, stride, rows)

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        # The fields in StructuredOutputsParams.kind's order: the first one set wins.
        if params.json is not None:
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON object (a schema)")
            if not self.allow_additional_properties:
                schema = close_objects(schema)
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if params.regex is not None:
            return llg.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            alts = " | ".join(json.dumps(c) for c in params.choice)
            return llg.LLMatcher.grammar_from_lark(f"start: {alts}")
        if params.grammar is not None:
            return llg.LLMatcher.grammar_from_lark(params.grammar)
        return llg.LLMatcher.grammar_from_json_schema(_ANY_JSON_OBJECT, defaults=_JSON_OPTIONS)

    def validate(self, params: StructuredOutputsParams) -> None:
        text = self.grammar_text(params)
        is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer, limits=_limits())
        if is_error:
            raise ValueError(f"invalid structured_outputs.{params.kind}: {msgs[0].strip()}")
        self.compile(params, text)

    def compile(self, params: StructuredOutputsParams, text: str | None = None) -> LLGuidanceGrammar:
        m = llg.LLMatcher(self.tokenizer, text or self.grammar_text(params), log_level=0,
                          limits=_limits())
        self._warm(m)
        if m.is_error():
            why = (m.get_error() or "").strip().splitlines()[0][:300]
            if "too many" in why or "fuel" in why:
                why += f" (more lexer work than this server allows: llguidance limits {LEXER_LIMITS})"
            raise ValueError(f"invalid structured_outputs.{params.kind}: {why}")
        return LLGuidanceGrammar(m)


    def _warm(self, m: llg.LLMatcher) -> None:
        """Build the lexer's first states here (the edge, the compile pool),
        never on the step thread: the first mask, and the mask after one
        allowed token (a huge repetition like a{100000} is cheap at the start
        and blows up on the next state), then roll back. A grammar past the
        limits leaves `m` in error."""
        mask = np.zeros(self._words, dtype=np.int32)
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if m.is_error():
            return
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        token = next((int(t) for t in allowed if int(t) != self._eos), None)
        if token is None or not m.consume_token(token):
            return
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if not m.is_error():
            m.rollback(1)


def make_llguidance_backend(tokenizer_dir: str, vocab_size: int, eos_token_id: int | None,
          allow_additional_properties: bool = False) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer_dir, vocab_size, eos_token_id, allow_additional_properties)
