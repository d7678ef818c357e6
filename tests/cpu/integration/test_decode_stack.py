"""DecodeStack (conveyor/workers/models/decode_stack.py): decode steps of up to
the small-M kernels' rows run as one native call (csrc/decode_layers.cpp). Its
tokens and logprobs are the module path's bit for bit, in fp32, bf16 and int8,
with a qkv bias (Qwen2), on the plain kernel's rows (1-2), the packed kernel's
(up to 8), and for int8 past the int8 kernel's 16 rows (the prefill-sized op);
a model it does not cover (Qwen3's q/k norm) never takes it."""
from __future__ import annotations

from typing import Any

import pytest
from llm_utils import random_prompts

from conveyor import LLM, SamplingParams
from conveyor.kernels import cpu_attention
from conveyor.workers.models.decode_stack import DecodeStack


def _run(model: str, monkeypatch: pytest.MonkeyPatch, stack: bool, seqs: int = 2,
         **kw: Any) -> tuple[list[Any], list[int]]:
    """Greedy tokens and top-5 logprobs of seqs + 1 prompts, seqs at a time
    (decode steps of 1 to seqs rows), and how many steps the stack ran, and
    how many of those in its one native call."""
    monkeypatch.setenv("CONVEYOR_DECODE_STACK", "1" if stack else "0")
    steps = [0, 0]
    run = DecodeStack.run

    def counted(self: DecodeStack, *a: Any) -> Any:
        steps[0] += 1
        return run(self, *a)

    monkeypatch.setattr(DecodeStack, "run", counted)
    ext = cpu_attention.load_extension()
    native = ext.decode_layers

    def native_counted(*a: Any) -> Any:
        steps[1] += 1
        return native(*a)

    monkeypatch.setattr(ext, "decode_layers", native_counted)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    with LLM(model=model, max_model_len=128, max_num_seqs=seqs, **kw) as llm:
        outs = llm.generate(random_prompts(seqs + 1, 5, 40, seed=4), sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs], steps


@pytest.mark.parametrize("family,kw", [("llama", {}), ("llama", {"dtype": "bfloat16"}),
                                       ("llama", {"quantization": "int8"}), ("qwen2", {}),
                                       ("llama", {"seqs": 8}), ("llama", {"seqs": 20, "quantization": "int8"})],
                         ids=["llama-fp32", "llama-bf16", "llama-int8", "qwen2-bias", "llama-fp32-8rows",
                              "llama-int8-20rows"])
def test_stack_steps_equal_the_modules_bit_for_bit(family: str, kw: dict[str, Any], tiny_llama: str,
                                                   tiny_qwen2: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[family]
    fast, (ran, native) = _run(model, monkeypatch, True, **kw)
    slow, off = _run(model, monkeypatch, False, **kw)
    # 12 tokens: 11 decode steps for the first wave of prompts and 11 for the last one.
    assert ran >= 22 and off == [0, 0]
    # Every step it takes is one native call, the packed kernel's rows and int8's past 16 too.
    assert native == ran
    assert fast == slow


def test_a_model_it_does_not_cover_runs_its_modules(tiny_qwen3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    outs, ran = _run(tiny_qwen3, monkeypatch, True)
    assert ran == [0, 0] and all(len(t) == 12 for t, _ in outs)
