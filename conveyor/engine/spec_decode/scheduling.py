"""The scheduler's side of speculative decoding (kept out of scheduler.py).

Invariants:
- a request's drafts live in Request.spec_token_ids and extend what it
  catches up to: len(all_token_ids) + len(spec_token_ids);
- drafts are proposed only right after a step appended tokens, so the request
  is caught up except for its last token; they never run past max_tokens or
  max_model_len (the bonus token included);
- after a step, num_computed_tokens rolls back by the rejected drafts, and the
  drafts are gone; rejected tokens never enter all_token_ids, so never a block
  hash: prefix caching stays exact;
- a structured-output request's drafts are a prefix its grammar accepts
  (cut at the first token it rejects), so its matcher can give one mask row per
  draft position (Scheduler.get_grammar_bitmask); the matcher itself only
  advances by the tokens update_from_output appends;
- a request whose drafts keep being rejected backs off: after its n-th
  consecutive verification with nothing accepted it is not drafted for the
  next min(2**n - 1, MAX_BACKOFF) steps (text that does not repeat itself
  would otherwise pay 1 + k query tokens per step for nothing). The choice
  depends only on the request's own history, so outputs stay exact (greedy:
  the same tokens; random: the rejection sampler is exact for any draft) and
  seeded requests stay batch-independent.
"""
from __future__ import annotations

from conveyor.engine.config import SpeculativeConfig
from conveyor.engine.core.request import Request
from conveyor.engine.spec_decode.ngram import NgramProposer

MAX_BACKOFF = 16  # steps a request goes undrafted, at most, after rejected drafts


class SpecDecodeScheduling:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int) -> None:
        self.k = cfg.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(cfg.num_speculative_tokens, cfg.prompt_lookup_min,
                                      cfg.prompt_lookup_max)
        # request id -> (consecutive all-rejected verifications, steps left undrafted)
        self._backoff: dict[str, tuple[int, int]] = {}
        self._reset_stats()

    def _reset_stats(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.accepted_per_pos = [0] * self.k

    @staticmethod
    def scheduled_drafts(request: Request, num_new: int) -> list[int]:
        """The drafts covered by num_new scheduled tokens (a budget cut drops the
        tail); they replace the request's pending drafts."""
        n = request.num_computed_tokens + num_new - len(request.all_token_ids)
        drafts = request.spec_token_ids[:n] if n > 0 else []
        request.spec_token_ids = drafts
        return drafts

    def verify(self, request: Request, drafts: list[int], num_sampled: int) -> None:
        """The worker emitted num_sampled tokens (accepted drafts + 1): roll the
        computed prefix back past the rejected drafts."""
        accepted = min(max(num_sampled - 1, 0), len(drafts))
        request.num_computed_tokens -= len(drafts) - accepted
        request.spec_token_ids = []
        rid = request.request_id
        if accepted:
            self._backoff.pop(rid, None)
        else:
            misses = self._backoff.get(rid, (0, 0))[0] + 1
            self._backoff[rid] = (misses, min(2 ** misses - 1, MAX_BACKOFF))
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def propose(self, request: Request) -> None:
        """Runs for every running request every step, drafts or not: the
        common no-draft path is a few attribute reads and the proposer's miss."""
        rid = request.request_id
        backoff = self._backoff
        if backoff:
            wait = backoff.get(rid)
            if wait is not None and wait[1] > 0:
                backoff[rid] = (wait[0], wait[1] - 1)
                request.spec_token_ids = []
                return
        tokens = request.all_token_ids
        # Drafts + the bonus token must fit both length caps.
        room = min(request.max_tokens - len(request.output_token_ids),
                   self.max_model_len - len(tokens)) - 1
        drafts = self.proposer.propose(rid, tokens, room)
        if drafts:
            sor = request.structured_output
            if sor is not None:
                # A token the grammar rejects could never be accepted, and the
                # mask after it is undefined: the draft ends before it.
                drafts = drafts[:sor.grammar.valid_prefix(drafts)]
        request.spec_token_ids = drafts

    def drop(self, request_id: str) -> None:
        self.proposer.drop(request_id)
        self._backoff.pop(request_id, None)

    def take_stats(self) -> dict:
        out = dict(spec_num_drafts=self.num_drafts, spec_num_draft_tokens=self.num_draft_tokens,
                   spec_num_accepted_tokens=self.num_accepted,
                   spec_accepted_per_pos=list(self.accepted_per_pos))
        self._reset_stats()
        return out
