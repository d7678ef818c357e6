"""IncrementalDetokenizer: token ids -> text, one request, as tokens arrive.

Decoding uses vLLM's prefix_offset/read_offset scheme: each new token is
decoded together with a few tokens of left context, ids[prefix_offset:], and
the text beyond decode(ids[prefix_offset:read_offset]) is the delta. Context
matters because decoders are not concatenative per token (byte-level BPE
tokens may hold part of a UTF-8 character; SentencePiece strips a leading
space at the start of a string). A decode ending in U+FFFD means the last
character is still incomplete, so nothing is emitted and the offsets stay put
until later tokens complete it.

Invariants:
- `output_text` only grows, except once: when a stop string matches, it is cut
  at (or just after) the match; nothing before the cut changes.
- The cut never reaches text already returned by get_delta(stream=True): the
  last len(longest stop)-1 characters are held back until the request ends, and
  a new match always ends inside newly decoded text.
- After a stop string matched the detokenizer is frozen: later updates are
  ignored (the engine may still deliver tokens that were in flight).
"""
from __future__ import annotations

from conveyor.engine.frontend.tokenizer import Tokenizer

# Left context taken from the prompt: enough for any UTF-8 character (<= 4
# bytes, i.e. <= 4 byte-level tokens) plus a SentencePiece leading space.
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, *, min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # "" would match everywhere; SamplingParams should reject it, but be safe.
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        longest = max((len(s) for s in self._stop), default=0)
        # With include_stop_str_in_output the stop text is part of the output, so
        # any prefix of it is safe to send and nothing needs holding back.
        self._holdback = 0 if self._include_stop else max(longest - 1, 0)

        # Only the prompt tail is needed as context; ids before prefix_offset are never read.
        self._ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._output_ids: list[int] = []
        self._text = ""
        self._sent = 0  # chars of _text already returned by get_delta
        self._stop_str: str | None = None
        self._flushed = False

    # ---- state ----------------------------------------------------------
    @property
    def output_text(self) -> str:
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_ids)

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the request, if any."""
        return self._stop_str

    # ---- updates --------------------------------------------------------
    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string that matched, else None.

        stop_terminated: the last token is an EOS / stop_token_ids hit. Its text is
        then left out of output_text (it is still in output_token_ids) unless
        include_stop_str_in_output, as in vLLM.
        """
        if self._stop_str is not None or not new_token_ids:
            return None
        self._output_ids.extend(new_token_ids)
        to_decode = new_token_ids
        if stop_terminated and not self._include_stop:
            to_decode = new_token_ids[:-1]
        old_len = len(self._text)
        self._text += "".join(self._decode_next(t) for t in to_decode)
        return self._check_stop(old_len)

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def _advance(self, final: bool) -> str:
        """Text of ids[read_offset:] if it is complete (or `final`), moving the offsets."""
        ids, prefix, read = self._ids, self._prefix_offset, self._read_offset
        if read >= len(ids):
            return ""
        prefix_text = self._decode(ids[prefix:read])
        new_text = self._decode(ids[prefix:])
        # Equal lengths: the new tokens decoded to nothing yet (skipped special
        # tokens, or bytes of an unfinished character); keep them pending.
        if len(new_text) <= len(prefix_text) or (
                new_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = read, len(ids)
        return new_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        # No clean-up: it rewrites across token boundaries, so it is not incremental.
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def _check_stop(self, old_len: int) -> str | None:
        """Find the stop string whose match completes first in the text after
        old_len (ties: the one starting earliest) and truncate there. "Completes
        first" is what a char-by-char stream would see, so the result does not
        depend on how tokens were batched into updates."""
        if not self._stop or len(self._text) == old_len:
            return None
        if len(self._output_ids) <= self._min_tokens:
            return None
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            # Start early enough that a match may straddle old and new text, but
            # late enough that it must end in new text (older text was checked).
            start = self._text.find(s, max(0, old_len - len(s) + 1))
            if start != -1 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return None
        end, start, s = best
        self._text = self._text[:end if self._include_stop else start]
        self._stop_str = s
        return s

    # ---- output ---------------------------------------------------------
    def finish(self) -> None:
        """The request ended: flush tokens pending as an incomplete character
        (U+FFFD, as a full decode gives). Idempotent; get_delta state untouched."""
        if self._flushed or self._stop_str is not None:
            return
        self._flushed = True
        old_len = len(self._text)
        self._text += self._advance(final=True)
        self._check_stop(old_len)

    def get_delta(self, stream: bool, finished: bool = False) -> str:
        """Text not returned before.

        stream=True: everything decoded so far except, until the request is
        finished or a stop string matched, the last len(longest stop)-1 chars
        (a stop string may still complete there and they would be cut).
        stream=False: "" until finished (or stopped), then all the text.
        finished=True also flushes tokens still pending as an incomplete
        character: a request that ends mid-character gets U+FFFD, exactly as a
        full decode would produce.
        """
        if finished:
            self.finish()
        done = finished or self._stop_str is not None
        if not stream and not done:
            return ""
        end = len(self._text) - (0 if done else self._holdback)
        if end <= self._sent:
            return ""
        delta = self._text[self._sent:end]
        self._sent = end
        return delta
