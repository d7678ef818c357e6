"""DecodeStack (conveyor/workers/models/decode_stack.py): decode steps of up to
the plain kernel's rows run as a flat loop of the modules' native calls. Its
tokens and logprobs are the module path's bit for bit, in fp32, bf16 and int8,
with a qkv bias (Qwen2); a model it does not cover (Qwen3's q/k norm) never
takes it."""
from __future__ import annotations

from typing import Any

import pytest
from llm_utils import random_prompts

from conveyor import LLM, SamplingParams
from conveyor.workers.models.decode_stack import DecodeStack


def _run(model: str, monkeypatch: pytest.MonkeyPatch, stack: bool, **kw: Any) -> tuple[list[Any], int]:
    """Greedy tokens and top-5 logprobs of 3 prompts, 2 at a time (decode
    steps of 1-2 rows), and how many steps the stack ran."""
    monkeypatch.setenv("CONVEYOR_DECODE_STACK", "1" if stack else "0")
    steps = [0]
    run = DecodeStack.run

    def counted(self: DecodeStack, *a: Any) -> Any:
        steps[0] += 1
        return run(self, *a)

    monkeypatch.setattr(DecodeStack, "run", counted)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    with LLM(model=model, max_model_len=128, max_num_seqs=2, **kw) as llm:
        outs = llm.generate(random_prompts(3, 5, 40, seed=4), sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs], steps[0]


@pytest.mark.parametrize("family,kw", [("llama", {}), ("llama", {"dtype": "bfloat16"}),
                                       ("llama", {"quantization": "int8"}), ("qwen2", {})],
                         ids=["llama-fp32", "llama-bf16", "llama-int8", "qwen2-bias"])
def test_stack_steps_equal_the_modules_bit_for_bit(family: str, kw: dict[str, Any], tiny_llama: str,
                                                   tiny_qwen2: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[family]
    fast, ran = _run(model, monkeypatch, True, **kw)
    slow, off = _run(model, monkeypatch, False, **kw)
    # 12 tokens: 11 decode steps per wave of 2 (bf16: the plain kernel's 2 rows) and 1.
    assert ran >= 11 and off == 0
    assert fast == slow


def test_a_model_it_does_not_cover_runs_its_modules(tiny_qwen3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    outs, ran = _run(tiny_qwen3, monkeypatch, True)
    assert ran == 0 and all(len(t) == 12 for t, _ in outs)
