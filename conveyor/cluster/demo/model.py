"""The demo checkpoint and the tiny tokenizer: `make run` serves the trained demo
model committed in conveyor/cluster/demo/assets/ (see conveyor/cluster/demo/train.py); tests build
small random-weight Llamas with a byte-level BPE tokenizer trained on the spot
(nothing is downloaded, ever).

    python -m conveyor.cluster.demo_model demo_model     # what `make run` builds if missing

`train_tiny_tokenizer(path)` writes tokenizer.json, tokenizer_config.json and
special_tokens_map.json so that both conveyor.engine.frontend.tokenizer.load_tokenizer(path) and
transformers.AutoTokenizer.from_pretrained(path) load it. Its output is a pure
function of `vocab_size`: the corpus is built by index arithmetic (no RNG) and
the BPE trainer breaks ties deterministically. The tests build their tiny
checkpoints with the same code (tests/cpu/tokenizer_utils.py re-exports it).

Special token ids are fixed: <s>=0 (bos), </s>=1 (eos), <unk>=2, <pad>=3.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD]

# Role markers are plain text (not added tokens) so they tokenize like prose.
# Tools (HF's `tools` variable) go first as a system turn, one JSON schema a
# line; assistant tool calls render in the hermes format the default
# tool-call parser reads back; tool results are `tool` turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\n# Tools\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['tool_calls'] is defined %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ eos_token + '\\n' }}"
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


def train_tokenizer_on(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `texts`, special tokens at ids 0-3."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # Llama-style: BOS is prepended by the post-processor, never EOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != [0, 1, 2, 3]:
        raise RuntimeError("special tokens did not get ids 0-3")
    return tok


def build_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    return train_tokenizer_on(tiny_corpus(), vocab_size)


def save_tokenizer(tok: Tokenizer, path: str, chat_template: str | None = CHAT_TEMPLATE,
                   model_max_length: int = 2048) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json into `path`."""
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    special_map = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(os.path.join(path, "tokenizer_config.json"), config)
    _write_json(os.path.join(path, "special_tokens_map.json"), special_map)


def train_tiny_tokenizer(path: str, vocab_size: int = 512,
                         chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Train and save into directory `path` (created if missing)."""
    save_tokenizer(build_tiny_tokenizer(vocab_size), path, chat_template)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---- the demo checkpoint ------------------------------------------------------------

DEMO_CONFIG: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=1024,
    initializer_range=0.05, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=3,  # the tokenizer's ids
)


def is_checkpoint(path: str) -> bool:
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all(os.path.isfile(os.path.join(path, n)) for n in names)


def make_demo_model(path: str, seed: int = 0) -> str:
    """Write the random-weight Llama (fp32 safetensors, config.json,
    generation_config.json) and the trained tokenizer into `path`.
    Written into a sibling temp directory and renamed, so an interrupted build
    never leaves a half checkpoint that `is_checkpoint` would accept."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo_model-", dir=parent)
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**DEMO_CONFIG), dtype=torch.float32)
        model.save_pretrained(tmp)
        train_tiny_tokenizer(tmp, vocab_size=DEMO_CONFIG["vocab_size"])
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is not a secret
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# The trained demo model (conveyor/cluster/demo/train.py: a small Llama trained on the
# docstrings of Python's standard library), committed so `make run` answers in
# sentences without a training run.
TRAINED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


def ensure_demo_model(path: str) -> bool:
    """Put the demo checkpoint at `path` unless one is already there; True if
    it was put there. The trained checkpoint when the repository has it, else a
    random-weight one (the text is then noise)."""
    if is_checkpoint(path):
        return False
    if is_checkpoint(TRAINED_DIR):
        import shutil

        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = path.rstrip("/") + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(TRAINED_DIR, tmp)
        os.replace(tmp, path)  # never a half checkpoint at `path`
        return True
    make_demo_model(path)
    return True


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    target = args[0] if args else "demo_model"
    print(f"{target}: {'built' if ensure_demo_model(target) else 'already there'}")


if __name__ == "__main__":
    main()
