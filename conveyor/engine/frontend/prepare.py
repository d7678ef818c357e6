"""What every frontend does before a request reaches the core: tokenize,
resolve EOS ids, check the engine's limits (once per request), fan `n` out
into child requests. Shared by LLM (offline) and AsyncLLM (serving, batch)."""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreRequest
from conveyor.engine.errors import ParamError
from conveyor.engine.frontend.json_limits import utf8_problem
from conveyor.engine.frontend.tokenizer import Tokenizer, eos_of_model_dir, load_tokenizer
from conveyor.engine.lora import LoRARequest, ModelDims, check_adapter
from conveyor.engine.multimodal.chat import media_policy, render_chat
from conveyor.engine.multimodal.features import MultiModalFeature
from conveyor.engine.multimodal.inputs import ImageInputs, MultiModalInputError, split_prompt
from conveyor.engine.sampling_params import SamplingFields, child_seed, resolved_max_tokens
from conveyor.engine.structured_output.backend import StructuredOutputBackend
from conveyor.engine.structured_output.params import StructuredOutputsParams
from conveyor.engine.structured_output.registry import make_backend

# A dict: {"prompt": str} or {"prompt_token_ids": [...]}, with optional
# "multi_modal_data": {"image": image or [images]} (multimodal/inputs.py).
Prompt = str | list[int] | dict
_VALID_SPECS_CACHED = 256


@dataclass
class PreparedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[EngineCoreRequest]  # one per n, ids "<request_id>-<k><suffix>"
    # Data parallel: the session the router keeps together (x-session-id / `user`).
    session: str | None = None


class ContextLengthError(ValueError):
    """The prompt plus the completion do not fit max_model_len."""

    def __init__(self, prompt_len: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds "
                         f"max_model_len ({max_model_len})")
        self.prompt_len, self.max_tokens, self.max_model_len = prompt_len, max_tokens, max_model_len


def check_engine_limits(ids: list[int], sp: SamplingFields, config: EngineConfig,
                        vocab_size: int) -> None:
    """The checks that depend on this engine, once per request before anything
    is queued (the fields themselves were checked when the SamplingParams was
    built). Raises ValueError naming the field, or ContextLengthError."""
    n, max_len = len(ids), config.max_model_len
    if n == 0:
        raise ValueError("prompt must not be empty")
    if sp.n > config.model.max_n:
        raise ParamError("n", f"n must be <= {config.model.max_n}, got {sp.n}")
    max_tokens = resolved_max_tokens(sp, n, max_len)
    if n + max(max_tokens, 1) > max_len:
        raise ContextLengthError(n, max(max_tokens, 1), max_len)
    if sp.min_tokens > max_tokens:
        raise ParamError(
            "min_tokens", f"min_tokens ({sp.min_tokens}) must be <= the {max_tokens} tokens the completion may "
            f"have (max_tokens, or max_model_len {max_len} minus the {n}-token prompt)")
    if vocab_size and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"prompt_token_ids must be in [0, {vocab_size})")
    if vocab_size and sp.stop_token_ids and max(sp.stop_token_ids) >= vocab_size:
        raise ParamError("stop_token_ids",
                         f"stop_token_ids must be in [0, {vocab_size}), got {max(sp.stop_token_ids)}")
    _check_token_ids(sp, vocab_size)


def _check_token_ids(sp: SamplingFields, vocab_size: int) -> None:
    """Token ids the sampler indexes the logits with: below the vocab size."""
    if not vocab_size:
        return
    if sp.logit_bias and max(sp.logit_bias) >= vocab_size:
        raise ParamError("logit_bias", f"logit_bias token ids must be < the vocab size {vocab_size}, "
                                       f"got {max(sp.logit_bias)}")
    if sp.allowed_token_ids is not None:
        if max(sp.allowed_token_ids) >= vocab_size:
            raise ParamError("allowed_token_ids", f"allowed_token_ids must be < the vocab size {vocab_size}, "
                                                  f"got {max(sp.allowed_token_ids)}")
        if len(sp.allowed_token_ids) > vocab_size:
            raise ParamError("allowed_token_ids", f"allowed_token_ids must hold at most {vocab_size} ids")


class Frontend:
    def __init__(self, config: EngineConfig, vocab_size: int = 0) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.tokenizer = _maybe_tokenizer(config)
        self.eos_token_id, self.extra_eos = _eos_ids(config, self.tokenizer)
        self._grammar_backend: StructuredOutputBackend | None = None
        self._valid_specs: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.loras = LoRARegistry(config) if config.lora.enable else None
        self._invalid_specs: OrderedDict[tuple[str, str], str] = OrderedDict()  # -> the error
        self._specs_lock = threading.Lock()
        self.images = ImageInputs.for_model(config)  # None: the model takes text only
        if self.images is not None and config.lora.enable:
            raise ValueError("lora.enable: LoRA adapters on a vision-language model are not supported yet")

    def prepare(self, prompt: Prompt, sp: SamplingFields, request_id: str,
                priority: int = 0, id_suffix: str = "",
                lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Tokenize, check the engine's limits once, fan n out. `id_suffix`
        makes the children's engine ids unique per call (a client that reuses
        its request id never shares engine ids with the earlier request)."""
        prompt, images = split_prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json: pass token ids")
            problem = utf8_problem(prompt)
            if problem is not None:  # the tokenizer would raise TypeError
                raise ValueError(f"prompt {problem}")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        features: list[MultiModalFeature] = []
        if images:
            ids, features = self._expand_images(ids, images)
        check_engine_limits(ids, sp, self.config, self.vocab_size)
        if sp.structured_outputs is not None:
            self.validate_structured_outputs(sp.structured_outputs)
        if lora_request is not None:
            if self.loras is None:
                raise ValueError("lora_request: LoRA is not enabled in this engine "
                                 "(LLM(..., enable_lora=True) or YAML lora.enable: true)")
            self.loras.check(lora_request)
        extra: dict[str, object] = {}
        # Extra EOS ids of generation_config.json stop like stop_token_ids (vLLM).
        if self.extra_eos and not sp.ignore_eos:
            extra["stop_token_ids"] = sorted(set(sp.stop_token_ids) | self.extra_eos)
        now = time.time()
        children = [EngineCoreRequest(request_id=f"{request_id}-{k}{id_suffix}", prompt_token_ids=ids,
                                      sampling_params=sp.trusted_copy(n=1, seed=child_seed(sp.seed, k),
                                                                      **extra, **_child_only(k, sp)),
                                      eos_token_id=self.eos_token_id, arrival_time=now, priority=priority,
                                      lora_request=lora_request, mm_features=features)
                    for k in range(sp.n)]
        return PreparedRequest(request_id, text, ids, children)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> Prompt:
        """OpenAI-shaped messages (text and image parts: multimodal/chat.py)
        through the chat template -> a prompt for prepare(). The template
        holds the special tokens it wants: none are added."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json: chat is unavailable")
        msgs, images = render_chat(messages, self.image_placeholder(), media_policy(self.config))
        text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt, chat_template)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids

    def image_placeholder(self) -> str | None:
        """The text an image part becomes (LLaVA: "<image>"; Qwen2.5-VL:
        "<|vision_start|><|image_pad|><|vision_end|>"); None: text only."""
        if self.images is None or self.tokenizer is None:
            return None
        return "".join(str(self.tokenizer.convert_ids_to_tokens(i)) for i in self.images.placeholder_ids)

    def _expand_images(self, ids: list[int], images: list) -> tuple[list[int], list[MultiModalFeature]]:
        if self.images is None:
            raise MultiModalInputError(f"model {os.path.basename(self.config.model.path.rstrip('/'))!r} takes "
                                       "text only: image inputs need a vision-language model")
        return self.images.expand(ids, images)

    def validate_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile-check the constraint before anything is queued (ValueError).
        Specs that passed are remembered (LRU), so each is checked once.
        Thread-safe: the HTTP server checks on its prep pool (one at a time:
        each check is bounded by the backend's limits)."""
        with self._specs_lock:
            self._validate_structured(params)

    def _validate_structured(self, params: StructuredOutputsParams) -> None:
        key = (params.kind, params.spec_text())
        if key in self._valid_specs:
            self._valid_specs.move_to_end(key)
            return
        refused = self._invalid_specs.get(key)
        if refused is not None:  # a grammar bomb sent again costs a lookup, not a compile
            raise ValueError(refused)
        if self._grammar_backend is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer.json")
            vocab = self.vocab_size or len(self.tokenizer)
            self._grammar_backend = make_backend(self.config.structured_outputs.backend,
                                                 self.config.model.tokenizer or self.config.model.path,
                                                 vocab, self.eos_token_id,
                                                 self.config.structured_outputs.allow_additional_properties)
        try:
            self._grammar_backend.validate(params)
        except ValueError as e:
            self._invalid_specs[key] = str(e)
            if len(self._invalid_specs) > _VALID_SPECS_CACHED:
                self._invalid_specs.popitem(last=False)
            raise
        self._valid_specs[key] = None
        if len(self._valid_specs) > _VALID_SPECS_CACHED:
            self._valid_specs.popitem(last=False)


class LoRARegistry:
    """The adapters this frontend has checked (by id) and the named ones
    (lora.adapters at start, plus any loaded at run time), ids from 1."""

    def __init__(self, config: EngineConfig) -> None:
        self.max_rank = config.lora.max_lora_rank
        self.dims = ModelDims.from_model_dir(config.model.path)
        self.by_id: dict[int, LoRARequest] = {}
        self.by_name: dict[str, LoRARequest] = {}
        # Ids are never reused: a worker may still cache an unloaded adapter's weights by id.
        self._next_id = 1 << 20
        for name, path in config.lora.adapters.items():
            self.add(name, path)

    def check(self, lr: LoRARequest) -> None:
        """ValueError naming what is wrong with the request's adapter (checked once per id)."""
        if not isinstance(lr, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lr).__name__}")
        if not isinstance(lr.lora_int_id, int) or lr.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id: expected an int >= 1, got {lr.lora_int_id!r}")
        known = self.by_id.get(lr.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lr.lora_name, lr.lora_path):
                raise ValueError(f"lora_request.lora_int_id: {lr.lora_int_id} already names adapter "
                                 f"{known.lora_name!r} ({known.lora_path}); give each adapter its own id")
            return
        check_adapter(lr.lora_path, self.max_rank, self.dims)
        self.by_id[lr.lora_int_id] = lr

    def add(self, name: str, path: str) -> LoRARequest:
        """Register a named adapter (checked) under the next free id."""
        if name in self.by_name:
            raise ValueError(f"lora_name: adapter {name!r} is already loaded")
        if not name or ":" in name:
            raise ValueError(f"lora_name: expected a non-empty name without ':', got {name!r}")
        lr = LoRARequest(name, self._next_id, path)
        self.check(lr)
        self._next_id += 1
        self.by_name[name] = lr
        return lr

    def remove(self, name: str) -> LoRARequest:
        lr = self.by_name.pop(name, None)
        if lr is None:
            raise KeyError(name)
        self.by_id.pop(lr.lora_int_id, None)
        return lr

    def resolve(self, model: str, base_name: str) -> LoRARequest | None:
        """The adapter a `model` field names ("<adapter>" or "<base>:<adapter>"),
        None for the base model itself; KeyError when it names nothing known."""
        if model == base_name:
            return None
        head, sep, tail = model.partition(":")
        name = tail if sep and head == base_name else model
        lr = self.by_name.get(name)
        if lr is None:
            raise KeyError(model)
        return lr
def _child_only(k: int, sp: SamplingFields) -> dict[str, object]:
    """Prompt logprobs are the prompt's, not a choice's: only child 0 computes
    them (the others may then read the prefix cache)."""
    return {"prompt_logprobs": None} if k and sp.prompt_logprobs is not None else {}


def _maybe_tokenizer(config: EngineConfig) -> Tokenizer | None:
    path = config.model.tokenizer or config.model.path
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    return load_tokenizer(path)


def eos_token_id_of(config: EngineConfig) -> int | None:
    return _eos_ids(config, _maybe_tokenizer(config))[0]


def _eos_ids(config: EngineConfig, tok: Tokenizer | None) -> tuple[int | None, set[int]]:
    """(eos_token_id, the other ids that end generation): the tokenizer's
    resolution (conveyor/engine/frontend/tokenizer.py: resolve_eos), or the same rule over the
    checkpoint's files when it has no tokenizer."""
    eos, ids = (tok.eos_token_id, set(tok.eos_token_ids)) if tok is not None else \
        eos_of_model_dir(config.model.path)
    return eos, ids - {eos}
