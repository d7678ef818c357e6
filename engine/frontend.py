"""What every frontend does before a request reaches the core: tokenize,
resolve EOS ids, check the engine's limits (once per request), fan `n` out
into child requests. Shared by LLM (offline) and AsyncLLM (serving, batch)."""
from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.contracts import EngineCoreRequest
from engine.sampling_params import SamplingFields, child_seed
from engine.structured_output.backend import StructuredOutputBackend, make_backend
from engine.structured_output.params import StructuredOutputsParams
from engine.tokenizer import Tokenizer, load_tokenizer

Prompt = str | list[int]
_VALID_SPECS_CACHED = 256


@dataclass
class PreparedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[EngineCoreRequest]  # one per n, ids "<request_id>-<k><suffix>"


class ContextLengthError(ValueError):
    """The prompt plus the completion do not fit max_model_len."""

    def __init__(self, prompt_len: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds "
                         f"max_model_len ({max_model_len})")
        self.prompt_len, self.max_tokens, self.max_model_len = prompt_len, max_tokens, max_model_len


def resolved_max_tokens(sp: SamplingFields, prompt_len: int, max_model_len: int) -> int:
    """max_tokens None means up to max_model_len minus the prompt (vLLM)."""
    return sp.max_tokens if sp.max_tokens is not None else max_model_len - prompt_len


def check_engine_limits(ids: list[int], sp: SamplingFields, config: EngineConfig,
                        vocab_size: int) -> None:
    """The checks that depend on this engine, once per request before anything
    is queued (the fields themselves were checked when the SamplingParams was
    built). Raises ValueError naming the field, or ContextLengthError."""
    n, max_len = len(ids), config.max_model_len
    if n == 0:
        raise ValueError("prompt must not be empty")
    if sp.n > config.model.max_n:
        raise ValueError(f"n must be <= {config.model.max_n}, got {sp.n}")
    max_tokens = resolved_max_tokens(sp, n, max_len)
    if n + max(max_tokens, 1) > max_len:
        raise ContextLengthError(n, max(max_tokens, 1), max_len)
    if sp.min_tokens > max_tokens:
        raise ValueError(
            f"min_tokens ({sp.min_tokens}) must be <= the {max_tokens} tokens the completion may "
            f"have (max_tokens, or max_model_len {max_len} minus the {n}-token prompt)")
    if vocab_size and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"prompt_token_ids must be in [0, {vocab_size})")


class Frontend:
    def __init__(self, config: EngineConfig, vocab_size: int = 0) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.tokenizer = _maybe_tokenizer(config)
        self.eos_token_id, self.extra_eos = _eos_ids(config, self.tokenizer)
        self._grammar_backend: StructuredOutputBackend | None = None
        self._valid_specs: OrderedDict[tuple[str, str], None] = OrderedDict()

    def prepare(self, prompt: Prompt, sp: SamplingFields, request_id: str,
                priority: int = 0, id_suffix: str = "") -> PreparedRequest:
        """Tokenize, check the engine's limits once, fan n out. `id_suffix`
        makes the children's engine ids unique per call (a client that reuses
        its request id never shares engine ids with the earlier request)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json: pass token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        check_engine_limits(ids, sp, self.config, self.vocab_size)
        if sp.structured_outputs is not None:
            self.validate_structured_outputs(sp.structured_outputs)
        extra: dict[str, object] = {}
        # Extra EOS ids of generation_config.json stop like stop_token_ids (vLLM).
        if self.extra_eos and not sp.ignore_eos:
            extra["stop_token_ids"] = sorted(set(sp.stop_token_ids) | self.extra_eos)
        now = time.time()
        children = [EngineCoreRequest(request_id=f"{request_id}-{k}{id_suffix}", prompt_token_ids=ids,
                                      sampling_params=sp.trusted_copy(n=1, seed=child_seed(sp.seed, k), **extra),
                                      eos_token_id=self.eos_token_id, arrival_time=now, priority=priority)
                    for k in range(sp.n)]
        return PreparedRequest(request_id, text, ids, children)

    def validate_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile-check the constraint before anything is queued (ValueError).
        Specs that passed are remembered (LRU), so each is checked once."""
        key = (params.kind, params.spec_text())
        if key in self._valid_specs:
            self._valid_specs.move_to_end(key)
            return
        if self._grammar_backend is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer.json")
            vocab = self.vocab_size or len(self.tokenizer)
            self._grammar_backend = make_backend(self.config.structured_outputs.backend,
                                                 self.config.model.tokenizer or self.config.model.path,
                                                 vocab, self.eos_token_id,
                                                 self.config.structured_outputs.allow_additional_properties)
        self._grammar_backend.validate(params)
        self._valid_specs[key] = None
        if len(self._valid_specs) > _VALID_SPECS_CACHED:
            self._valid_specs.popitem(last=False)


def _maybe_tokenizer(config: EngineConfig) -> Tokenizer | None:
    path = config.model.tokenizer or config.model.path
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    return load_tokenizer(path)


def eos_token_id_of(config: EngineConfig) -> int | None:
    return _eos_ids(config, _maybe_tokenizer(config))[0]


def _eos_ids(config: EngineConfig, tok: Tokenizer | None) -> tuple[int | None, set[int]]:
    if tok is not None:
        return tok.eos_token_id, set(tok.eos_token_ids) - {tok.eos_token_id}
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = os.path.join(config.model.path, name)
        if os.path.isfile(f):
            with open(f) as fh:
                v = json.load(fh).get("eos_token_id")
            if v is not None:
                ids = v if isinstance(v, list) else [v]
                break
    return (ids[0] if ids else None), set(ids[1:])
