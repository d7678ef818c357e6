"""engine.tokenizer / engine.detokenizer against a tiny byte-level BPE tokenizer
trained on the spot, with transformers.AutoTokenizer as the reference."""
from __future__ import annotations

import json
import os
import random

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer, load_tokenizer
from tests.cpu.tokenizer_utils import build_tiny_tokenizer, tiny_corpus, train_tiny_tokenizer

TEXTS = [
    "",
    "Hello world",
    "The café owner reads a crème brûlée today.",
    "A naïve student finds 日本語の本 in 東京.",
    "emoji 😀 and more 😀😀 in a row",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\nhere",
    "special <s> tokens </s> inline <pad>",
    "numbers 1234567890 and symbols !@#$%^&*()",
    "unseen words: Ωmega, ДОБРЫЙ, مرحبا, 🚀🛰️",
] + tiny_corpus()[:20]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_tok"))
    train_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir: str) -> Tokenizer:
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


# ---- tokenizer_utils ----------------------------------------------------
def test_training_is_deterministic_and_fast(tmp_path) -> None:
    import time
    t0 = time.perf_counter()
    a, b = build_tiny_tokenizer().to_str(), build_tiny_tokenizer().to_str()
    assert (time.perf_counter() - t0) / 2 < 2.0
    assert a == b
    train_tiny_tokenizer(str(tmp_path), vocab_size=300)
    assert load_tokenizer(str(tmp_path)).vocab_size == 300


# ---- parity with AutoTokenizer -----------------------------------------
def test_properties_match_hf(tok: Tokenizer, hf) -> None:
    assert hf.is_fast
    assert tok.vocab_size == len(hf) == 512
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (0, 1)
    assert tok.eos_token_ids == {1}
    assert tok.all_special_ids == hf.all_special_ids
    assert tok.pad_token_id == hf.pad_token_id == 3
    assert tok.model_max_length == 2048
    ids = list(range(0, 512, 7))
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    assert tok.convert_ids_to_tokens([0, 5], skip_special_tokens=True) == [hf.convert_ids_to_tokens(5)]


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_decode_match_hf(tok: Tokenizer, hf, add_special: bool) -> None:
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=add_special)
        assert ids == hf.encode(text, add_special_tokens=add_special), text
        assert (ids[:1] == [tok.bos_token_id]) == add_special  # BOS from the post-processor
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(TEXTS[3], add_special_tokens=False)) == TEXTS[3]


def test_decode_random_ids_match_hf(tok: Tokenizer, hf) -> None:
    rng = random.Random(0)
    for _ in range(50):  # random byte tokens produce invalid UTF-8 -> U+FFFD
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode([43, 10_000]) == tok.decode([43])  # out-of-vocab ids are skipped


# ---- config resolution and errors ---------------------------------------
def _write(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


def test_generation_config_eos_wins(tmp_path) -> None:
    d = str(tmp_path)
    train_tiny_tokenizer(d)
    _write(os.path.join(d, "generation_config.json"), {"eos_token_id": [3, 1]})
    t = load_tokenizer(d)
    assert t.eos_token_id == 1 and t.eos_token_ids == {1, 3}  # tokenizer's eos stays primary
    _write(os.path.join(d, "generation_config.json"), {"eos_token_id": 3})
    t = load_tokenizer(d)
    assert t.eos_token_id == 3 and t.eos_token_ids == {1, 3}


def test_config_json_fallback(tmp_path) -> None:
    d = str(tmp_path)
    train_tiny_tokenizer(d)
    os.remove(os.path.join(d, "special_tokens_map.json"))
    _write(os.path.join(d, "tokenizer_config.json"), {"unk_token": "<unk>"})
    _write(os.path.join(d, "config.json"), {"bos_token_id": 0, "eos_token_id": 1})
    t = load_tokenizer(d)
    assert (t.bos_token_id, t.eos_token_id, t.eos_token_ids) == (0, 1, {1})
    assert t.bos_token is None and t.all_special_ids == [2]


def test_missing_files_name_the_path(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(missing)
    empty = str(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(empty)
    train_tiny_tokenizer(empty)
    with open(os.path.join(empty, "tokenizer_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(empty)
    with open(os.path.join(empty, "tokenizer.json"), "w") as f:
        f.write("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(empty)


# ---- chat templates ------------------------------------------------------
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi, café?"},
            {"role": "assistant", "content": "Oui."},
            {"role": "user", "content": "日本語"}]


@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_hf(tok: Tokenizer, hf, gen: bool) -> None:
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen)
    assert ours == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    assert ours.startswith("<s><|system|>\nBe brief.</s>\n")
    assert ours.endswith("<|assistant|>\n") == gen


def test_chat_template_raise_exception(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="Unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_default_chat_template(tmp_path) -> None:
    d = str(tmp_path)
    train_tiny_tokenizer(d, chat_template=None)
    t = load_tokenizer(d)
    assert t.chat_template is None
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "yo"},
                                              {"type": "image_url", "image_url": "x"}],
             "name": None}]
    assert t.apply_chat_template(msgs) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert t.apply_chat_template(msgs[:1], add_generation_prompt=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"
    assert t.apply_chat_template(msgs[:1], chat_template="{{ messages|tojson }}") == \
        '[{"role": "user", "content": "hi"}]'
    # The sandbox refuses attribute escapes from untrusted templates.
    with pytest.raises(Exception):
        t.apply_chat_template(msgs, chat_template="{{ ''.__class__.__mro__ }}")
    assert DEFAULT_CHAT_TEMPLATE


def test_chat_template_jinja_file_wins(tmp_path) -> None:
    d = str(tmp_path)
    train_tiny_tokenizer(d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert load_tokenizer(d).apply_chat_template(MESSAGES[:2]) == "[Be brief.][Hi, café?]"
