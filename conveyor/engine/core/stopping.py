"""When a request stops, decided token by token as the scheduler appends
sampled tokens (stop strings are the detokenizer's: conveyor/engine/frontend/detokenizer.py)."""
from __future__ import annotations

from typing import Any

from conveyor.engine.contracts import RequestStatus
from conveyor.engine.core.request import Request


def check_stop(request: Request, max_model_len: int) -> bool:
    """EOS, then stop_token_ids, then the length caps (vLLM's order).
    min_tokens suppresses only the first two: the caps always hold, so a
    request never grows past max_model_len (the block table's width)."""
    sp = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= sp.min_tokens:
        last = request.output_token_ids[-1]
        if not sp.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if sp.stop_token_ids and last in sp.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if len(request.all_token_ids) >= max_model_len or num_output >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def grammar_done(request: Request, grammar: Any, token: int) -> bool:
    """Advance the matcher by an accepted token; a complete output stops the request."""
    if not grammar.accept_tokens([token]):
        # The mask allowed only grammar tokens, so this is an engine defect:
        # end the request rather than emit output that does not parse.
        request.status = RequestStatus.FINISHED_ERROR
        # A matcher that hit its resource limits (a schema that forces
        # unbounded nesting: "Too many items") says why: the client's mistake.
        why = getattr(grammar, "error", lambda: None)()
        request.stop_reason = (f"structured output grammar failed: {why}" if why
                               else "grammar rejected a sampled token")
        return True
    if grammar.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED
        request.stopped_by_grammar = True
        return True
    return False
