"""A tiny byte-level BPE tokenizer trained on the spot (tests never download).

`train_tiny_tokenizer(path)` writes tokenizer.json, tokenizer_config.json and
special_tokens_map.json so that both engine.tokenizer.load_tokenizer(path) and
transformers.AutoTokenizer.from_pretrained(path) load it. Output is a pure
function of `vocab_size`: the corpus is built by index arithmetic (no RNG) and
the BPE trainer breaks ties deterministically.

Special token ids are fixed: <s>=0 (bos), </s>=1 (eos), <unk>=2, <pad>=3.
"""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD]

# Role markers are plain text (not added tokens) so they tokenize like prose.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_SUBJECTS = ["the cat", "a dog", "my friend", "the engine", "our model", "the teacher",
             "a small bird", "the old man", "this request", "the scheduler", "her brother",
             "the café owner", "a naïve student", "the GPU", "every token"]
_VERBS = ["runs", "sees", "likes", "builds", "reads", "writes", "finds", "loves",
          "stops", "decodes", "serves", "caches", "visits", "eats", "schedules"]
_OBJECTS = ["the ball", "a book", "some tea", "the garden", "a long story", "the river",
            "fresh bread", "the blocks", "many requests", "a crème brûlée", "日本語の本",
            "the résumé", "an über fast kernel", "the city of São Paulo", "a jalapeño"]
_TAILS = ["today.", "every day.", "at night!", "with joy.", "in the morning?",
          "slowly, then quickly.", "again and again.", "for 42 minutes.", "— naturally.",
          "without a sound.", "in Zürich.", "très bien.", "😀 happily.", "(twice)", "in 東京."]


def tiny_corpus() -> list[str]:
    """A few hundred distinct sentences; mixes ASCII, Latin-1, CJK and emoji
    so 2-, 3- and 4-byte UTF-8 sequences all occur in training and in tests."""
    lines = []
    for i in range(400):
        # Coprime strides walk the lists in different orders -> varied combos.
        s = _SUBJECTS[i % len(_SUBJECTS)]
        v = _VERBS[(i * 7 + 3) % len(_VERBS)]
        o = _OBJECTS[(i * 11 + 5) % len(_OBJECTS)]
        t = _TAILS[(i * 13 + 1) % len(_TAILS)]
        lines.append(f"{s[0].upper()}{s[1:]} {v} {o} {t}")
    return lines


def build_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    # Llama-style: BOS is prepended by the post-processor, never EOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    return tok


def train_tiny_tokenizer(path: str, vocab_size: int = 512,
                         chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Train and save into directory `path` (created if missing)."""
    os.makedirs(path, exist_ok=True)
    tok = build_tiny_tokenizer(vocab_size)
    tok.save(os.path.join(path, "tokenizer.json"))
    special_map = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(os.path.join(path, "tokenizer_config.json"), config)
    _write_json(os.path.join(path, "special_tokens_map.json"), special_map)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
