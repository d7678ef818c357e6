"""conveyor.engine.frontend.tokenizer / conveyor.engine.frontend.detokenizer against a tiny byte-level BPE tokenizer
trained on the spot, with transformers.AutoTokenizer as the reference."""
from __future__ import annotations

import json
import os
import random

import pytest

from conveyor.engine.frontend.detokenizer import IncrementalDetokenizer
from conveyor.engine.frontend.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer, load_tokenizer
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
def test_training_is_deterministic(tmp_path) -> None:
    a, b = build_tiny_tokenizer().to_str(), build_tiny_tokenizer().to_str()
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


def test_a_checkpoint_without_tokenizer_resolves_eos_by_the_same_rule(tmp_path) -> None:
    """One EOS rule: a token-id-only checkpoint gets generation_config's ids
    first and config.json's as a fallback, as load_tokenizer does."""
    from conveyor.engine.frontend.tokenizer import eos_of_model_dir

    d = str(tmp_path)
    _write(os.path.join(d, "config.json"), {"eos_token_id": 7})
    assert eos_of_model_dir(d) == (7, {7})
    _write(os.path.join(d, "generation_config.json"), {"eos_token_id": [5, 6]})
    assert eos_of_model_dir(d) == (5, {5, 6, 7})


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
    with pytest.raises(ValueError, match="unsafe"):
        t.apply_chat_template(msgs, chat_template="{{ ''.__class__.__mro__ }}")
    assert DEFAULT_CHAT_TEMPLATE


def test_chat_template_jinja_file_wins(tmp_path) -> None:
    d = str(tmp_path)
    train_tiny_tokenizer(d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert load_tokenizer(d).apply_chat_template(MESSAGES[:2]) == "[Be brief.][Hi, café?]"


# ---- incremental detokenization -----------------------------------------
def _detok(tok: Tokenizer, prompt: str = "Once", skip: bool = True, stop: list[str] | None = None,
           include: bool = False, **kw) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, tok.encode(prompt), skip_special_tokens=skip,
                                  stop=stop or [], include_stop_str_in_output=include, **kw)


def _with_specials(tok: Tokenizer, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    return ids[:3] + [tok.bos_token_id, 3] + ids[3:] + [tok.eos_token_id]


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_every_prefix_equals_full_decode(tok: Tokenizer, skip: bool) -> None:
    for text in TEXTS:
        ids = _with_specials(tok, text)
        det = _detok(tok, skip=skip)
        for k in range(1, len(ids) + 1):
            assert det.update([ids[k - 1]]) is None
            out = det.output_text
            assert "\ufffd" not in out  # never a half character
            # Only the tokens of an unfinished character (<= 3 byte tokens) lag behind.
            lagging = [tok.decode(ids[:j], skip_special_tokens=skip) for j in range(max(0, k - 3), k + 1)]
            assert out in lagging, (text, k)
        assert out == tok.decode(ids, skip_special_tokens=skip)
        assert det.get_delta(stream=False, finished=True) == out
        assert det.output_token_ids == ids


def test_incremental_random_ids_and_flush(tok: Tokenizer) -> None:
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 25))]
        det = _detok(tok, skip=rng.random() < 0.5)
        full = tok.decode(ids, skip_special_tokens=det._skip_special)
        pos = 0
        while pos < len(ids):  # random batch sizes: same text as one-by-one
            n = rng.randrange(1, 4)
            det.update(ids[pos:pos + n])
            pos += n
            assert full.startswith(det.output_text)
        # Pending bytes that never formed a character are flushed as U+FFFD at the end.
        det.get_delta(stream=True, finished=True)
        assert det.output_text == full


def test_multibyte_split_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # the 4-byte emoji spans several byte tokens
    det = _detok(tok)
    for t in ids[:-1]:
        det.update([t])
        assert det.output_text == "" and det.get_delta(stream=True) == ""
    det.update(ids[-1:])
    assert det.output_text == "😀"
    # A request that ends mid-character gets U+FFFD, as a full decode would.
    det = _detok(tok)
    det.update(ids[:-1])
    assert det.get_delta(stream=True, finished=True) == tok.decode(ids[:-1])
    assert det.output_text.endswith("\ufffd")


# ---- stop strings ---------------------------------------------------------
def _run(tok: Tokenizer, text: str, stop: list[str], include: bool = False,
         batch: int = 1, **kw) -> tuple[IncrementalDetokenizer, str | None, list[str]]:
    """Feed text's tokens `batch` at a time, collecting streamed deltas; checks
    that what was streamed is always a prefix of the final text."""
    ids = tok.encode(text, add_special_tokens=False)
    det = _detok(tok, stop=stop, include=include, **kw)
    deltas, matched = [], None
    for i in range(0, len(ids), batch):
        matched = det.update(ids[i:i + batch])
        deltas.append(det.get_delta(stream=True))
        if matched:
            break
    deltas.append(det.get_delta(stream=True, finished=True))
    final = det.output_text
    assert "".join(deltas) == final
    for k in range(len(deltas)):
        assert final.startswith("".join(deltas[:k]))
    return det, matched, deltas


def test_stop_earliest_match_wins(tok: Tokenizer) -> None:
    text = "The cat sees the garden today. A dog runs."
    for batch in (1, 3, 100):  # batching tokens into updates must not matter
        det, matched, _ = _run(tok, text, ["dog", "garden", "sees the"], batch=batch)
        assert matched == det.stop_str == "sees the"
        assert det.output_text == "The cat "
    # Overlapping: "bcd" completes before "abcde" starts mattering.
    det, matched, _ = _run(tok, "xx abcde yy", ["abcde", "bcd"], batch=100)
    assert (matched, det.output_text) == ("bcd", "xx a")
    # Same end: the longer (earlier-starting) match wins.
    det, matched, _ = _run(tok, "xx abcde yy", ["cde", "abcde"], batch=100)
    assert (matched, det.output_text) == ("abcde", "xx ")


@pytest.mark.parametrize("include", [False, True])
def test_stop_truncation(tok: Tokenizer, include: bool) -> None:
    text = "My friend likes some tea. The river is blue."
    det, matched, _ = _run(tok, text, [". The"], include=include)
    assert matched == ". The"
    assert det.output_text == ("My friend likes some tea. The" if include else "My friend likes some tea")
    # Later tokens (already in flight) are ignored after the stop.
    n = det.num_output_tokens
    assert det.update(tok.encode(" more", add_special_tokens=False)) is None
    assert det.num_output_tokens == n and det.output_text.endswith("tea" + ". The" * include)


def test_stop_string_spanning_two_tokens(tok: Tokenizer) -> None:
    text = "The scheduler caches many requests with joy."
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    # Take a stop string made of the tail of one token and the head of the next.
    k = next(i for i in range(1, len(pieces)) if len(pieces[i - 1]) >= 2 and len(pieces[i]) >= 2)
    stop = pieces[k - 1][-2:] + pieces[k][:2]
    det = _detok(tok, stop=[stop])
    for i in range(k):
        assert det.update([ids[i]]) is None
    assert det.update([ids[k]]) == stop
    assert det.output_text == "".join(pieces[:k])[:-2]


def test_streaming_never_leaks_partial_stop(tok: Tokenizer) -> None:
    stops = ["river", "tea. The", "日本語の本"]
    for text in tiny_corpus()[:60] + TEXTS:
        for include in (False, True):
            det, matched, deltas = _run(tok, text, stops, include=include)
            streamed = "".join(deltas[:-1])  # before the request finished
            if matched and not include:
                assert matched not in det.output_text
                # Nothing from the matched stop string was ever streamed.
                assert len(streamed) <= text.index(matched)
            if not matched:
                assert det.output_text == tok.decode(tok.encode(text, add_special_tokens=False))
                assert not any(s in det.output_text for s in stops)


def test_holdback_released_on_finish(tok: Tokenizer) -> None:
    det = _detok(tok, stop=["STOPPER"])
    det.update(tok.encode("abc STOP", add_special_tokens=False))
    assert det.get_delta(stream=True) == "ab"  # "c STOP" could still become "STOPPER"
    assert det.get_delta(stream=False) == ""  # non-streaming: nothing until finished
    assert det.get_delta(stream=True, finished=True) == "c STOP"
    assert det.get_delta(stream=True, finished=True) == ""


def test_min_tokens_and_stop_terminated(tok: Tokenizer) -> None:
    ids = tok.encode("a dog runs. a dog eats.", add_special_tokens=False)
    det = _detok(tok, stop=["dog"], min_tokens=len(ids) - 1)
    det.update(ids[:-1])
    assert det.stop_str is None  # matches before min_tokens are not checked
    # stop_terminated: the final EOS text is not part of the output.
    det = _detok(tok, skip=False)
    det.update(ids + [tok.eos_token_id], stop_terminated=True)
    assert det.output_text == "a dog runs. a dog eats." and det.output_token_ids[-1] == tok.eos_token_id
    det = _detok(tok, skip=False, include=True)
    det.update(ids + [tok.eos_token_id], stop_terminated=True)
    assert det.output_text.endswith("</s>")


def test_incremental_sentencepiece_style_decoder() -> None:
    """Metaspace + byte-fallback (Llama-2 style): the leading-space strip and
    <0x..> byte tokens both need the left context the detokenizer keeps."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers
    b = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
    b.pre_tokenizer = pre_tokenizers.Metaspace()
    b.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    b.train_from_iterator(tiny_corpus(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<unk>"] + bytes_, show_progress=False))
    t = Tokenizer(b, special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
                  extra_special_tokens=[], chat_template=None, bos_token_id=0, eos_token_id=1,
                  eos_token_ids={1}, model_max_length=None, clean_up_tokenization_spaces=False,
                  name_or_path="mem")
    prompt, out = t.encode("Hello there"), t.encode(" go 🚀 Ωx", add_special_tokens=False)
    assert "<0xF0>" in t.convert_ids_to_tokens(out)
    # Byte tokens are special here, so keep them (skip_special_tokens=False).
    det = IncrementalDetokenizer(t, prompt, skip_special_tokens=False, stop=[],
                                 include_stop_str_in_output=False)
    for i in out:
        det.update([i])
        assert "\ufffd" not in det.output_text
    full = t.decode(prompt + out, skip_special_tokens=False)
    assert det.output_text == full[len(t.decode(prompt, skip_special_tokens=False)):] == " go 🚀 Ωx"
