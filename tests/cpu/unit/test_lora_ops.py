"""Multi-LoRA building blocks without an engine: the segmented matmuls (CPU
torch paths, the fused CPU op on each kernel table this CPU runs, and the
Triton shrink/expand kernel under TRITON_INTERPRET=1; fp32, small shapes)
against the row-by-row torch reference; PEFT adapter checks
(every unsupported field named); config fields; prefix-cache keys."""
from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module import

import numpy as np
import pytest
import torch

from conveyor.engine.config import ConfigError, build_config
from conveyor.engine.lora import LoRARequest, ModelDims, check_adapter
from conveyor.workers.lora.mapping import LoRAMapping, add_lora

pytest.importorskip("triton")


def _build(token_slots: np.ndarray, slots: int) -> LoRAMapping:
    """The mapping with the torch paths (the fused CPU op is tested on its own below)."""
    mp = LoRAMapping.build(token_slots, slots, torch.device("cpu"))
    assert mp is not None
    mp.cpu_isa = None
    return mp


def _case(seed: int, num_tokens: int, slots: int, k: int, r: int, n: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g)
    y = torch.randn(num_tokens, n, generator=g)
    a_t = torch.randn(slots + 1, k, r, generator=g)
    b_t = torch.randn(slots + 1, r, n, generator=g)
    a_t[slots], b_t[slots] = 0, 0  # the wrappers' zero slot
    token_slots = np.random.default_rng(seed).integers(-1, slots, num_tokens)
    return x, y, a_t, b_t, token_slots


@pytest.mark.parametrize("seed,num_tokens,slots,k,r,n", [(0, 37, 4, 48, 8, 40), (1, 5, 3, 64, 24, 96),
                                                         (2, 70, 2, 20, 4, 33)])
def test_segmented_lora_matches_reference(seed: int, num_tokens: int, slots: int, k: int, r: int,
                                          n: int) -> None:
    from conveyor.kernels.lora_triton import lora_reference, segmented_mm

    x, y, a_t, b_t, token_slots = _case(seed, num_tokens, slots, k, r, n)
    ref = lora_reference(x, y, a_t, b_t, token_slots.tolist())
    mp = _build(token_slots, slots)
    cpu = y.clone()
    add_lora(x, cpu, a_t, b_t, mp)  # the CPU bmm path
    scale = ref.abs().max()
    assert (cpu - ref).abs().max() / scale < 1e-5, f"seed {seed}"
    # The Triton shrink then expand, as the CUDA path runs them.
    tri = y.clone()
    shrunk = torch.empty(mp.rows.numel(), r)
    segmented_mm(x, a_t, shrunk, mp.rows, mp.positions, mp.seg_start, mp.seg_slot, mp.m, add=False)
    segmented_mm(shrunk, b_t, tri, mp.positions, mp.rows, mp.seg_start, mp.seg_slot, mp.m, add=True)
    assert (tri - ref).abs().max() / scale < 1e-5, f"seed {seed}"


def test_uneven_groups_take_the_sorted_path_and_match_the_reference() -> None:
    """Prefill-like steps (one adapter with most tokens) skip the padding."""
    from conveyor.kernels.lora_triton import lora_reference

    x, y, a_t, b_t, token_slots = _case(3, 200, 3, 24, 6, 20)
    token_slots[:190] = 1
    mp = _build(token_slots, 3)
    assert not mp.padded
    ref = lora_reference(x, y, a_t, b_t, token_slots.tolist())
    got = y.clone()
    add_lora(x, got, a_t, b_t, mp)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5


def test_long_runs_take_the_runs_path_and_match_the_reference() -> None:
    """Prefill chunks (long same-adapter runs in token order) add in place, no copies."""
    from conveyor.kernels.lora_triton import lora_reference

    x, y, a_t, b_t, _ = _case(4, 160, 3, 24, 6, 20)
    token_slots = np.repeat(np.array([0, -1, 2, 2, 1]), [40, 20, 30, 10, 60])
    mp = _build(token_slots, 3)
    assert mp.runs == [(0, 40, 0), (60, 100, 2), (100, 160, 1)]
    ref = lora_reference(x, y, a_t, b_t, token_slots.tolist())
    got = y.clone()
    add_lora(x, got, a_t, b_t, mp)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5


# (tokens, slots, K, rank, output widths of the sub-projections): decode-like
# and prefill-like (segments longer than one 16-row chunk), fused q/k/v and
# gate/up, widths and ranks off the vector width (masked tails).
_FUSED_CASES = [(37, 4, 48, 8, [40, 17, 17]), (5, 3, 64, 24, [96]), (70, 2, 20, 4, [33, 9]),
                (64, 16, 96, 16, [64, 32, 32])]


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_fused_cpu_op_matches_reference(isa: str) -> None:
    """conveyor/kernels/lora_cpu.py's op on one kernel table against the row-by-row
    reference: every sub-projection into its own columns of a wider y, x a
    column slice of a wider tensor (a row-parallel layer's narrowed input),
    base-model rows untouched. add_lora takes it whenever the extension is
    loaded, with the table the attention backend selected."""
    from conveyor.kernels import cpu_attention

    if not cpu_attention.available():
        pytest.skip(f"the CPU kernel did not build: {cpu_attention.build_error()}")
    from conveyor.kernels.lora_cpu import kernel_isa, lora_add, supported_isas

    if isa not in supported_isas():
        pytest.skip(f"this CPU does not run {isa}")
    for seed, (num_tokens, slots, k, r, outs) in enumerate(_FUSED_CASES):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(num_tokens, k + 5, generator=g)[:, 2:k + 2]
        y = torch.randn(num_tokens, sum(outs) + 7, generator=g)
        a_t = torch.randn(slots + 1, k, len(outs) * r, generator=g)
        bs = [torch.randn(slots + 1, r, n, generator=g) for n in outs]
        offs = [7 + sum(outs[:i]) for i in range(len(outs))]
        token_slots = np.random.default_rng(seed).integers(-1, slots, num_tokens)
        ref = y.clone()
        for t, s in enumerate(token_slots.tolist()):
            if s >= 0:
                shrunk = x[t] @ a_t[s]
                for i, (off, n) in enumerate(zip(offs, outs)):
                    ref[t, off:off + n] += shrunk[i * r:(i + 1) * r] @ bs[i][s]
        mp = LoRAMapping.build(token_slots, slots, torch.device("cpu"))
        assert mp is not None and mp.cpu_isa == kernel_isa() == cpu_attention.isa()
        got = y.clone()
        lora_add(x, got, a_t, bs, offs, mp.rows, mp.segs, isa)
        assert (got - ref).abs().max() / ref.abs().max() < 1e-5, f"{isa} case {seed}"
        base_rows = torch.from_numpy(token_slots < 0)
        assert torch.equal(got[base_rows], y[base_rows]) and torch.equal(got[:, :7], y[:, :7])
        if isa == mp.cpu_isa:  # the wrappers' entry point runs the same op
            subs = [(slice(i * r, (i + 1) * r), slice(off, off + n), b) for i, (off, n, b) in
                    enumerate(zip(offs, outs, bs))]
            via = y.clone()
            add_lora(x, via, a_t, None, mp, subs)
            assert torch.equal(via, got)


def test_mapping_without_adapters_is_none() -> None:
    assert LoRAMapping.build(np.full(7, -1), 4, torch.device("cpu")) is None


_DIMS = ModelDims(hidden=64, intermediate=128, q_out=64, kv_out=32, num_layers=2)


def _write_adapter(d, cfg: dict, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return str(d)


def _q_tensors(r: int, layer: int = 0, module: str = "q_proj", fin: int = 64, fout: int = 64):
    pre = f"base_model.model.model.layers.{layer}.self_attn.{module}"
    return {f"{pre}.lora_A.weight": torch.ones(r, fin), f"{pre}.lora_B.weight": torch.ones(fout, r)}


@pytest.mark.parametrize("cfg_extra,tensors,field", [
    ({"r": 32}, None, "r: rank 32 exceeds lora.max_lora_rank (16)"),
    ({"target_modules": ["q_proj", "lm_head"]}, None, "target_modules"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"use_dora": True}, None, "use_dora"),
    ({"bias": "all"}, None, "bias"),
    ({"peft_type": "IA3"}, None, "peft_type"),
    ({}, _q_tensors(4, layer=5), "layer 5"),
    ({}, _q_tensors(4, fin=48), "shape"),
    ({}, {**_q_tensors(4), "base_model.model.lm_head.lora_A.weight": torch.ones(4, 64)}, "lm_head"),
])
def test_unsupported_adapter_names_the_field(tmp_path, cfg_extra, tensors, field) -> None:
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **cfg_extra}
    path = _write_adapter(tmp_path / "a", cfg, tensors if tensors is not None else _q_tensors(4))
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        check_adapter(path, 16, _DIMS)


def test_adapter_scale_and_rslora(tmp_path) -> None:
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    assert check_adapter(_write_adapter(tmp_path / "a", cfg, _q_tensors(4)), 16, _DIMS).scale == 2.0
    cfg["use_rslora"] = True
    assert check_adapter(_write_adapter(tmp_path / "b", cfg, _q_tensors(4)), 16, _DIMS).scale == 4.0
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        check_adapter(str(tmp_path), 16, _DIMS)


def test_lora_config_fields() -> None:
    c = build_config(model="", enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=5)
    assert (c.lora.enable, c.lora.max_loras, c.lora.max_lora_rank, c.lora.max_cpu_loras) == (True, 3, 8, 5)
    with pytest.raises(ConfigError, match="lora.max_cpu_loras"):
        build_config(model="", enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="lora.max_loras"):
        build_config(model="", enable_lora=True, max_loras=0)
    with pytest.raises(ConfigError, match="lora.enable"):
        build_config({"lora": {"adapters": {"x": "/nope"}}})


def test_prefix_cache_keys_include_the_adapter() -> None:
    from conveyor.engine.contracts import EngineCoreRequest
    from conveyor.engine.core.request import Request
    from conveyor.engine.kv_cache import BlockHasher
    from conveyor.engine.sampling_params import SamplingParams

    def hashes(lr):
        ecr = EngineCoreRequest(request_id="r", prompt_token_ids=list(range(40)),
                                sampling_params=SamplingParams(max_tokens=4), lora_request=lr)
        req = Request.from_engine_core_request(ecr, 128)
        BlockHasher(16).extend(req)
        return req.block_hashes

    base, a1, a2 = hashes(None), hashes(LoRARequest("a", 1, "/x")), hashes(LoRARequest("b", 2, "/x"))
    assert len(base) == 2 and not set(base) & set(a1) and not set(a1) & set(a2)
    assert hashes(LoRARequest("a", 1, "/x")) == a1


def test_lora_requests_info_metrics() -> None:
    """Running and waiting requests per adapter (vLLM's lora_requests_info)."""
    from types import SimpleNamespace

    from conveyor.cluster.openai.metrics import _lora_metrics
    from conveyor.engine.contracts import SchedulerStats
    from conveyor.engine.lora import lora_stats

    a, b = LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y")
    reqs = [SimpleNamespace(lora_request=lr) for lr in (a, a, None, b)]
    st = SchedulerStats(**lora_stats(4, reqs[:3], reqs[3:]))
    assert (st.lora_running, st.lora_waiting, st.max_loras) == ({"a": 2}, {"b": 1}, 4)
    fams = {f.name: f for f in _lora_metrics(st, "m")}
    info = fams["conveyor:lora_requests_info"].samples[0]
    assert info.labels == {"running_lora_adapters": "a", "waiting_lora_adapters": "b", "max_lora": "4"}
    running = fams["conveyor:lora_requests_running"].samples
    assert [(s.labels["lora_name"], s.value) for s in running] == [("a", 2)]
