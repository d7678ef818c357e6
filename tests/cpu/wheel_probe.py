"""Run by test_wheel.py with the venv that holds the installed (not editable)
wheel, from a directory outside the checkout: transformers builds and loads a
tiny Llama, Conveyor generates from it in the same process with the C++ CPU
kernel compiled from the installed sources, and the facts go to stdout as JSON.

    python wheel_probe.py WORK_DIR
"""
from __future__ import annotations

import json
import os
import sys

import torch
import transformers

import conveyor
from conveyor import LLM, SamplingParams
from conveyor.cluster.demo.model import build_tiny_tokenizer, save_tokenizer
from conveyor.kernels import cpu_attention

PROMPT = [1, 37, 212, 9, 88, 301, 45, 7, 150, 260]
NEW_TOKENS = 8


def build_checkpoint(path: str) -> None:
    save_tokenizer(build_tiny_tokenizer(512), path)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def hf_greedy(path: str) -> list[int]:
    """Greedy by hand (no eos handling), as Conveyor's ignore_eos runs."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # imports `kernels`
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            nxt = model(ids).logits[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(PROMPT):].tolist()


def main() -> None:
    ckpt = os.path.join(sys.argv[1], "tiny-llama")
    build_checkpoint(ckpt)
    expected = hf_greedy(ckpt)
    llm = LLM(model=ckpt, dtype="float32", max_model_len=256, num_gpu_blocks=64, attention_backend="cpu")
    try:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
    finally:
        llm.shutdown()
    import kernels  # Hugging Face's kernel hub, which transformers >= 5.25 requires

    ext = cpu_attention.load_extension()
    build_dir = os.path.dirname(ext.__file__)
    with open(os.path.join(build_dir, "build.ninja")) as f:
        ninja = f.read()
    print(json.dumps({
        "conveyor": conveyor.__file__, "kernels": kernels.__file__, "transformers": transformers.__version__,
        "csrc": cpu_attention._CSRC, "extension": ext.__file__, "isa": ext.isa(),
        "built_from_csrc": cpu_attention._CSRC in ninja,
        "hf": expected, "conveyor_tokens": list(out.outputs[0].token_ids),
    }))


if __name__ == "__main__":
    main()
