"""Train the demo model that `make run` serves: a small Llama that answers in English.

    python -m conveyor.cluster.demo.train OUT_DIR [--minutes 20] [--threads 2]

The corpus is on every machine without a download: the docstrings of Python's own
standard library, read with `ast` from the interpreter's source files (nothing is
imported, so no module's side effects run). Each docstring becomes one chat turn in
the demo template (conveyor.cluster.demo.model.CHAT_TEMPLATE): the user asks about a module,
class or function by name, the assistant answers with its docstring's prose. So the
model learns the template's shape and answers a question with sentences.

The result is a normal HF checkpoint (config.json, model.safetensors, tokenizer) of
about 7 MB; the committed copy is conveyor/cluster/demo/assets/ (see ensure_demo_model).
The model is tiny and trained for minutes: it writes words and sentences in the
style of Python's documentation, not correct facts.
"""
from __future__ import annotations

import argparse
import ast
import math
import os
import random
import re
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages",
             "ensurepip", "__pycache__", "config-3.11-x86_64-linux-gnu"}
QUESTIONS = ["What does {} do?", "Tell me about {}.", "Explain {}.", "How do I use {}?",
             "What is {}?", "Describe {}."]
MODEL_CONFIG = dict(
    hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=48, vocab_size=2048, max_position_embeddings=4096,
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
    bos_token_id=0, eos_token_id=1, pad_token_id=3,
)


def _prose(doc: str) -> str | None:
    """The first paragraphs of a docstring that read as sentences, or None."""
    paras = []
    for para in re.split(r"\n\s*\n", doc.strip()):
        text = " ".join(line.strip() for line in para.splitlines())
        if not text or ">>>" in text or text.count("(") > 4 or not text[0].isupper():
            break
        if sum(c.isalpha() or c == " " for c in text) < 0.85 * len(text):
            break
        paras.append(text)
        if sum(map(len, paras)) > 400:
            break
    out = " ".join(paras)
    return out if 30 <= len(out) <= 700 and out.endswith((".", "!", "?")) else None


def _docstrings(path: Path, module: str) -> Iterator[tuple[str, str]]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    doc = ast.get_docstring(tree)
    if doc:
        yield f"the {module} module", doc
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            if node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc:
                yield f"{module}.{node.name}", doc


def stdlib_pairs() -> list[tuple[str, str]]:
    """(subject, answer) pairs from the standard library's docstrings, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pairs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for subject, doc in _docstrings(path, module):
            answer = _prose(doc)
            if answer is not None:
                pairs.append((subject, answer))
    return pairs + _topic_pairs()


def _topic_pairs() -> list[tuple[str, str]]:
    """The language reference's topics (pydoc_data.topics: plain data, safe to import),
    one pair per prose paragraph."""
    from pydoc_data.topics import topics

    pairs = []
    for name in sorted(topics):
        subject = name.replace("-", " ")
        for para in re.split(r"\n\s*\n", topics[name]):
            answer = _prose(para)
            if answer is not None:
                pairs.append((subject, answer))
    return pairs


def chat_texts(pairs: list[tuple[str, str]], seed: int = 0) -> list[str]:
    """Each pair as one rendered chat (the demo template, without the BOS token)."""
    rng = random.Random(seed)
    out = []
    for subject, answer in pairs:
        question = rng.choice(QUESTIONS).format(subject)
        out.append(f"<|user|>\n{question}</s>\n<|assistant|>\n{answer}</s>\n")
    return out


def _token_stream(tok, texts: list[str]) -> list[int]:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)  # the post-processor puts BOS first: one document each
    return ids


def _lr(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def train(out: str, minutes: float, threads: int, seq_len: int = 256, batch: int = 16) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from conveyor.cluster.demo.model import save_tokenizer, train_tokenizer_on

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    texts = chat_texts(stdlib_pairs())
    tok = train_tokenizer_on(texts, MODEL_CONFIG["vocab_size"])
    data = torch.tensor(_token_stream(tok, texts), dtype=torch.long)
    print(f"{len(texts)} chats, {len(data)} tokens", flush=True)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL_CONFIG), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    # Steps are sized from a timed first step so the cosine schedule ends on time.
    t0, step, total = time.monotonic(), 0, 10**9
    while step < total:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,))
        x = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = _lr(step, min(total, 10**6), 3e-3)
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1].clone()).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 5:
            total = int(minutes * 60 / ((time.monotonic() - t0) / 5))
            print(f"{total} steps planned", flush=True)
        if step % 50 == 0:
            print(f"step {step}/{total} loss {loss.item():.3f}", flush=True)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(tok, out, model_max_length=MODEL_CONFIG["max_position_embeddings"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    train(args.out, args.minutes, args.threads)


if __name__ == "__main__":
    main()
