"""Tokenizer: a thin wrapper over a `tokenizers` fast tokenizer plus the HF
side-car configs (tokenizer_config.json, special_tokens_map.json,
generation_config.json, config.json, chat_template.jinja).

Only fast tokenizers (tokenizer.json) are supported. Behaviour follows what
transformers (v5) AutoTokenizer produces for the same directory:
- BOS/EOS insertion is whatever tokenizer.json's post-processor does. v5 drops
  `add_bos_token`/`add_eos_token` from tokenizer_config.json when a
  tokenizer.json exists, and so do we; a missing post-processor adds nothing.
- Named special tokens missing from tokenizer.json are added as special tokens.
- `clean_up_tokenization_spaces` is applied on decode only for non-BPE models
  (v5 refuses to apply it to BPE, where it corrupts text).
Deliberate difference: truncation/padding configured in tokenizer.json is
disabled; the engine validates prompt length itself and never truncates silently.

No torch/transformers imports here; jinja2 is imported lazily on first use of
apply_chat_template.
"""
from __future__ import annotations

import json
import os
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _BackendTokenizer

# Same attribute set and order as transformers' SPECIAL_TOKENS_ATTRIBUTES, so
# all_special_ids lists ids in the same order HF does.
SPECIAL_TOKEN_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token",
                       "pad_token", "cls_token", "mask_token")

# ChatML, used when the tokenizer ships no template. Content may be a string or
# a list of OpenAI-style parts; only text parts are rendered.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(eq=False, repr=False)
class Tokenizer:
    """Immutable after construction (the backend is configured once in
    load_tokenizer), so one instance may be shared by many detokenizers."""

    backend: _BackendTokenizer
    _: KW_ONLY
    special_tokens: dict[str, str]  # attr name -> token text, e.g. bos_token -> "<s>"
    extra_special_tokens: list[str]
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: set[int]
    model_max_length: int | None
    clean_up_tokenization_spaces: bool
    name_or_path: str
    # Derived from the above once, in __post_init__.
    vocab_size: int = field(init=False)
    all_special_tokens: list[str] = field(init=False)
    all_special_ids: list[int] = field(init=False)
    max_token_chars: int = field(init=False)

    def __post_init__(self) -> None:
        backend, special_tokens = self.backend, self.special_tokens
        vocab = backend.get_vocab(with_added_tokens=True)
        # Ids may be sparse; vocab_size bounds every id so embeddings can be sized from it.
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        self.all_special_tokens = _unique(
            [special_tokens[a] for a in SPECIAL_TOKEN_ATTRS if a in special_tokens]
            + self.extra_special_tokens)
        self.all_special_ids = [i for i in (backend.token_to_id(t) for t in self.all_special_tokens)
                                if i is not None]
        self._is_bpe = type(backend.model).__name__ == "BPE"
        # The most characters one token can stand for (a vocab entry's text is
        # at least as long as what it encodes: one char per byte in byte-level
        # BPE, "<0x0A>" for one byte): a text longer than n * this needs more
        # than n tokens, so it is refused without tokenizing it.
        self.max_token_chars = max((len(t) for t in vocab), default=1) or 1
        self._compiled: dict[str, Any] = {}

    # ---- special tokens -------------------------------------------------
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        tok = self.special_tokens.get("pad_token")
        return None if tok is None else self.backend.token_to_id(tok)

    def __len__(self) -> int:
        return self.vocab_size

    # ---- encode / decode ------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_nogil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode() that releases the GIL while it runs (the backend's batch
        path does; its single encode does not): for large texts on a thread,
        so the event loop keeps running meanwhile."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Ids outside the vocabulary are skipped (backend behaviour), never an error:
        a model's embedding may be larger than the tokenizer's vocabulary."""
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        clean = (self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None
                 else clean_up_tokenization_spaces)
        return _clean_up_tokenization(text) if clean and not self._is_bpe else text

    def convert_ids_to_tokens(self, ids: int | list[int],
                              skip_special_tokens: bool = False) -> str | list[str]:
        """Unknown ids map to "" (unlike HF's None) so callers always get strings."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids) or ""
        special = set(self.all_special_ids) if skip_special_tokens else ()
        return [self.backend.id_to_token(i) or "" for i in ids if i not in special]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---- chat -----------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render to a string (not token ids). Template variables: every named
        special token (bos_token, eos_token, ...), messages, add_generation_prompt,
        then **kwargs (e.g. tools), which override. Keys whose value is None are
        dropped from messages, as HF does, so `'x' in message` tests behave.
        Raises ValueError for template errors, including raise_exception()."""
        import jinja2  # lazy: only chat needs it

        template = chat_template or self.chat_template or DEFAULT_CHAT_TEMPLATE
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, "messages": msgs,
                     "add_generation_prompt": add_generation_prompt, **kwargs}
        try:
            return self._compile(template).render(**variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    def _compile(self, template: str) -> Any:
        compiled = self._compiled.get(template)
        if compiled is None:
            compiled = _jinja_env().from_string(template)
            self._compiled[template] = compiled
        return compiled


# ---- loading ------------------------------------------------------------
def load_tokenizer(model_dir: str) -> Tokenizer:
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"tokenizer directory not found: {model_dir}")
    tok_path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise FileNotFoundError(
            f"tokenizer file not found: {tok_path} (only fast tokenizers with a "
            "tokenizer.json are supported)")
    try:
        backend = _BackendTokenizer.from_file(tok_path)
    except Exception as e:  # the Rust error does not name the file
        raise ValueError(f"cannot load tokenizer from {tok_path}: {e}") from e
    backend.no_truncation()
    backend.no_padding()

    tok_cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
    gen_cfg = _read_json(os.path.join(model_dir, "generation_config.json"))
    model_cfg = _read_json(os.path.join(model_dir, "config.json"))

    special = _named_special_tokens(tok_cfg, special_map)
    extra = _extra_special_tokens(tok_cfg, special_map)
    _register_special_tokens(backend, list(special.values()) + extra)

    bos_id, eos_id, eos_ids = _resolve_bos_eos(backend, special, gen_cfg, model_cfg)
    max_len = tok_cfg.get("model_max_length")
    return Tokenizer(
        backend, special_tokens=special, extra_special_tokens=extra,
        chat_template=_load_chat_template(model_dir, tok_cfg),
        bos_token_id=bos_id, eos_token_id=eos_id, eos_token_ids=eos_ids,
        # HF writes a huge sentinel (1e30) when the length is unknown.
        model_max_length=int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e18 else None,
        clean_up_tokenization_spaces=bool(tok_cfg.get("clean_up_tokenization_spaces", False)),
        name_or_path=model_dir)


def _read_json(path: str) -> dict:
    """Optional side-car config: {} when absent, ValueError naming the path when bad."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _token_text(value: Any) -> str | None:
    # Configs store a token either as text or as a serialized AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_special_tokens(tok_cfg: dict, special_map: dict) -> dict[str, str]:
    out: dict[str, str] = {}
    for attr in SPECIAL_TOKEN_ATTRS:
        # tokenizer_config.json wins; special_tokens_map.json is the older location.
        text = _token_text(tok_cfg.get(attr)) or _token_text(special_map.get(attr))
        if text is not None:
            out[attr] = text
    return out


def _extra_special_tokens(tok_cfg: dict, special_map: dict) -> list[str]:
    for cfg in (tok_cfg, special_map):
        for key in ("extra_special_tokens", "additional_special_tokens"):
            value = cfg.get(key)
            if isinstance(value, dict):  # v5 may store {name: token}
                value = list(value.values())
            if value:
                return _unique([t for t in map(_token_text, value) if t is not None])
    return []


def _register_special_tokens(backend: _BackendTokenizer, tokens: list[str]) -> None:
    """Make every configured special token an added special token of the
    backend (as HF does), so it is matched atomically in text and skipped by
    decode(skip_special_tokens=True). Tokens already added are left untouched."""
    added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    missing = [AddedToken(t, special=True, normalized=False)
               for t in _unique(tokens) if t not in added or not added[t].special]
    if missing:
        backend.add_special_tokens(missing)


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _resolve_bos_eos(backend: _BackendTokenizer, special: dict[str, str], gen_cfg: dict,
                     model_cfg: dict) -> tuple[int | None, int | None, set[int]]:
    """eos_token_id: generation_config.json wins over the tokenizer's eos token,
    which wins over config.json. When generation_config lists several and the
    tokenizer's eos is among them, that one is kept as the primary id.
    eos_token_ids: every id that ends generation (generation_config's list plus
    the tokenizer's own eos)."""
    def tok_id(attr: str) -> int | None:
        text = special.get(attr)
        return None if text is None else backend.token_to_id(text)

    eos, eos_ids = resolve_eos(tok_id("eos_token"), gen_cfg, model_cfg)
    bos = tok_id("bos_token")
    for cfg in (model_cfg, gen_cfg):
        if bos is None:
            bos = next(iter(_id_list(cfg.get("bos_token_id"))), None)
    return bos, eos, eos_ids


def resolve_eos(tok_eos: int | None, gen_cfg: dict, model_cfg: dict) -> tuple[int | None, set[int]]:
    """The one EOS rule, with or without a tokenizer (tok_eos: its eos token's
    id, or None). (eos_token_id, every id that ends generation)."""
    gen_eos = _id_list(gen_cfg.get("eos_token_id"))
    fallback = tok_eos if tok_eos is not None else next(iter(_id_list(model_cfg.get("eos_token_id"))), None)
    eos: int | None = fallback
    if gen_eos:
        eos = tok_eos if tok_eos is not None and tok_eos in gen_eos else gen_eos[0]
    return eos, set(gen_eos) | ({fallback} if fallback is not None else set())


def eos_of_model_dir(model_dir: str) -> tuple[int | None, set[int]]:
    """resolve_eos for a checkpoint without tokenizer.json (token-id prompts)."""
    return resolve_eos(None, _read_json(os.path.join(model_dir, "generation_config.json")),
                       _read_json(os.path.join(model_dir, "config.json")))


def _load_chat_template(model_dir: str, tok_cfg: dict) -> str | None:
    # Like HF: a chat_template.jinja file takes priority over the config entry.
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    value = tok_cfg.get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, dict)}
        value = named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) and value else None


# ---- helpers ------------------------------------------------------------
def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _clean_up_tokenization(text: str) -> str:
    # Same replacements as transformers' clean_up_tokenization.
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _jinja_env() -> Any:
    """Sandboxed environment configured like transformers' chat-template env:
    chat templates from model repos are untrusted code."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's builtin tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
