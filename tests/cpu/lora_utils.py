"""PEFT adapters for tests, made on the spot with `peft` at random non-zero A
and B (peft initialises B to zero, which would hide any mistake), and
transformers + peft's greedy reference running one adapter alone."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterRecipe:
    r: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False
    seed: int = 0


# Different ranks, target sets, alpha and rsLoRA: what the acceptance asks for.
RECIPES = (
    AdapterRecipe(8, 16, ALL_MODULES, seed=1),
    AdapterRecipe(4, 8, ("q_proj", "v_proj"), seed=2),
    AdapterRecipe(2, 4, ("o_proj", "gate_proj", "down_proj"), rslora=True, seed=3),
    AdapterRecipe(6, 3, ("k_proj", "up_proj", "down_proj", "q_proj"), seed=4),
)


def make_adapter(base_dir: str, out_dir: str, recipe: AdapterRecipe, std: float = 0.15) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=recipe.r, lora_alpha=recipe.alpha, target_modules=list(recipe.targets),
                     use_rslora=recipe.rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(recipe.seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(out_dir)
    return out_dir


@lru_cache(maxsize=16)
def _peft_model(base_dir: str, adapter_dir: str | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter_dir).eval()


def hf_lora_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]],
                   max_new_tokens: int) -> list[list[int]]:
    """transformers + peft greedy continuation with one adapter (None: the base), EOS ignored."""
    model = _peft_model(base_dir, adapter_dir)
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out
