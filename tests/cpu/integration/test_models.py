"""Model side: our models vs HF transformers on tiny random checkpoints, TP weight
slicing (faked ranks), PP stage splitting, and one real TP=2 x PP=2 gloo run."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import FAMILIES, make_tiny_model

from conveyor.parallel import state
from conveyor.parallel.communication import IntermediateTensors, recv_tensor_dict, send_tensor_dict
from conveyor.parallel.layers import QKVParallelLinear, narrow_load
from conveyor.parallel.state import divide
from conveyor.workers.hf_config import HFConfig
from conveyor.workers.layers.attention import find_attention_layers
from conveyor.workers.model_loader import load_hf_config, load_model
from conveyor.workers.models import get_model_class
from conveyor.workers.models.utils import PPMissingLayer, get_pp_layer_range

T = 40


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: make_tiny_model(f, root / f) for f in FAMILIES}


def _ids(n: int = T, seed: int = 1, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_logits(path: str, ids: torch.Tensor, positions: torch.Tensor | None = None
               ) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pos = None if positions is None else positions[None]
    with torch.no_grad():
        return hf(ids[None], position_ids=pos).logits[0]


def _our_logits(path: str, ids: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    positions = torch.arange(len(ids)) if positions is None else positions
    with torch.no_grad():
        return model.compute_logits(model(ids, positions))


# ------------------------------------------------------- HF equivalence ----

@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(ckpts: dict[str, str], family: str) -> None:
    ids = _ids()
    ours, ref = _our_logits(ckpts[family], ids), _hf_logits(ckpts[family], ids)
    assert ours.shape == (T, 512) and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() < 1e-4


def test_llama3_rope_at_large_positions(ckpts: dict[str, str]) -> None:
    ids, pos = _ids(), torch.arange(T) + 900
    ours = _our_logits(ckpts["llama3"], ids, pos)
    assert (ours - _hf_logits(ckpts["llama3"], ids, pos)).abs().max().item() < 1e-4


def test_sharded_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_model("qwen3", tmp_path / "m", max_shard_size="40KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    ids = _ids()
    assert (_our_logits(path, ids) - _hf_logits(path, ids)).abs().max().item() < 1e-4


def test_tied_embeddings_share_one_parameter(ckpts: dict[str, str]) -> None:
    path = ckpts["qwen2-tied"]
    assert "lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_parameter_is_named(tmp_path: Path, ckpts: dict[str, str]) -> None:
    path = tmp_path / "broken"
    path.mkdir()
    src = ckpts["llama"]
    for name in ("config.json", "generation_config.json"):
        (path / name).write_text(Path(src, name).read_text())
    weights = load_file(os.path.join(src, "model.safetensors"))
    del weights["model.layers.1.self_attn.v_proj.weight"]
    del weights["model.norm.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_model(str(path), load_hf_config(str(path)), torch.float32, "cpu")
    msg = str(e.value)
    assert "model.norm.weight" in msg and "model.layers.1.self_attn.qkv_proj.weight" in msg
    assert "shards ['v']" in msg


def test_registry(ckpts: dict[str, str]) -> None:
    cfg = load_hf_config(ckpts["mistral"])
    assert get_model_class(cfg).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class(HFConfig({**cfg.to_dict(), "architectures": ["GPT2LMHeadModel"]}))


_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM"}
# What the mixture-of-experts classes read (absent on dense families: None on both sides).
_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
             "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
             "qkv_bias")


def _what_models_read(c) -> dict:
    """Every value the model classes, the rotary table and the dtype choice
    take from an HF config, as they read it."""
    from conveyor.workers.layers.rotary import rope_params_from_config
    from conveyor.workers.models.llama import head_dim_of
    from conveyor.workers.worker import resolve_dtype

    window = getattr(c, "sliding_window", None)
    base, scaling, rotary_dim = rope_params_from_config(c)
    scaling = None if scaling is None else {k: v for k, v in scaling.items() if k != "rope_theta"}
    return {**{k: getattr(c, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "hidden_act", "max_position_embeddings", "rms_norm_eps", "architectures")},
        "kv_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        "head_dim": head_dim_of(c), "rope": (base, scaling, rotary_dim),
        "tied": bool(getattr(c, "tie_word_embeddings", False)),
        "biases": (bool(getattr(c, "attention_bias", False)), bool(getattr(c, "mlp_bias", False))),
        "window": window if window and getattr(c, "use_sliding_window", True) else None,
        "dtype": resolve_dtype("auto", c, torch.device("cuda")),
        **{k: getattr(c, k, None) for k in _MOE_KEYS}}


def test_config_reader_reads_what_transformers_reads(ckpts: dict[str, str], tmp_path: Path) -> None:
    """conveyor.workers.hf_config (no transformers import in the ranks) against
    AutoConfig: the tiny checkpoints, each family's class defaults (a
    config.json with nothing else), a switched-on Qwen2 window and legacy
    rope keys with Llama-3 scaling."""
    from transformers import AutoConfig

    dirs = dict(ckpts)
    extra = {f"bare-{t}": {"model_type": t, "architectures": [a]} for t, a in _ARCH.items()}
    extra["qwen2-window"] = {"model_type": "qwen2", "architectures": [_ARCH["qwen2"]],
                             "use_sliding_window": True, "sliding_window": 64, "torch_dtype": "bfloat16"}
    extra["qwen3-no-head-dim"] = {"model_type": "qwen3", "architectures": [_ARCH["qwen3"]],
                                  "hidden_size": 64, "num_attention_heads": 4}  # head_dim 128, not 16
    extra["llama-legacy-rope"] = {"model_type": "llama", "architectures": [_ARCH["llama"]], "rope_theta": 5e5,
                                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0}, "num_key_value_heads": 4}
    for name, raw in extra.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
        dirs[name] = str(tmp_path / name)
    for name, path in dirs.items():
        ours, ref = _what_models_read(load_hf_config(path)), _what_models_read(
            AutoConfig.from_pretrained(path, local_files_only=True))
        assert ours == ref, name
    assert _what_models_read(load_hf_config(dirs["qwen2-window"]))["window"] == 64
    with pytest.raises(AttributeError):
        getattr(load_hf_config(dirs["bare-llama"]), "no_such_key")  # noqa: B009 - the access is the test


def test_attention_layers_for_kv_allocation(ckpts: dict[str, str]) -> None:
    path = ckpts["llama"]
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    attns = find_attention_layers(model)
    assert len(attns) == 2
    assert attns[0].kv_cache_shape(10, 16) == (10, 2, 16, 2, 16)


# ------------------------------------------------------ fake TP slicing ----

def _fake_tp(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    monkeypatch.setattr(state, "tp_rank", lambda: rank)
    monkeypatch.setattr(state, "tp_size", lambda: size)


def test_tp2_rank1_loads_its_slices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model("qwen2", tmp_path / "m", vocab_size=511)  # odd vocab: padded
    hf = load_file(os.path.join(path, "model.safetensors"))
    _fake_tp(monkeypatch, 1, 2)
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    p = dict(model.named_parameters())
    a, pre = "model.layers.1.self_attn.", "model.layers.1."
    # 4 q heads / 2 kv heads of 16 -> rank 1 has q heads 2,3 and kv head 1.
    for kind in ("weight", "bias"):
        qkv = p[a + f"qkv_proj.{kind}"]
        assert torch.equal(qkv[:32], hf[a + f"q_proj.{kind}"][32:64])
        assert torch.equal(qkv[32:48], hf[a + f"k_proj.{kind}"][16:32])
        assert torch.equal(qkv[48:64], hf[a + f"v_proj.{kind}"][16:32])
    assert torch.equal(p[a + "o_proj.weight"], hf[a + "o_proj.weight"][:, 32:64])
    gate_up = p[pre + "mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up[:64], hf[pre + "mlp.gate_proj.weight"][64:128])
    assert torch.equal(gate_up[64:], hf[pre + "mlp.up_proj.weight"][64:128])
    assert torch.equal(p[pre + "mlp.down_proj.weight"], hf[pre + "mlp.down_proj.weight"][:, 64:])
    assert torch.equal(p[pre + "input_layernorm.weight"], hf[pre + "input_layernorm.weight"])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert p[name].shape == (256, 64)  # 511 padded to 512, rows 256..511
        assert torch.equal(p[name][:255], hf[name][256:])
        assert not p[name][255].any()


def _qkv_checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s: torch.randn(n * 16, 64, generator=g) for s, n in (("q", 4), ("k", 2), ("v", 2))}


def test_qkv_replicates_kv_heads_when_tp_exceeds_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _qkv_checkpoint()
    save_file(w, str(tmp_path / "w.safetensors"))
    _fake_tp(monkeypatch, 3, 4)  # 2 kv heads over 4 ranks: ranks 2,3 share kv head 1
    layer = QKVParallelLinear(64, 16, 4, 2, bias=False)
    assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (1, 1, 2)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        for s in "qkv":
            layer.weight.weight_loader(layer.weight, f.get_slice(s), s)
    expect = torch.cat([w["q"][48:64], w["k"][16:32], w["v"][16:32]])
    assert torch.equal(layer.weight, expect)
    fused = QKVParallelLinear(64, 16, 4, 2, bias=False)  # a pre-fused checkpoint tensor
    fused.weight.weight_loader(fused.weight, torch.cat([w["q"], w["k"], w["v"]]))
    assert torch.equal(fused.weight, expect)


def test_narrow_load_slice_equals_tensor(tmp_path: Path) -> None:
    w = torch.arange(60.0).reshape(6, 10)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        sl = f.get_slice("w")
        for dim, start, size in ((0, 2, 3), (1, 4, 5), (1, 0, 0)):
            assert torch.equal(narrow_load(sl, dim, start, size), w.narrow(dim, start, size))


def test_uneven_splits_name_the_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="14 is not divisible by 4"):
        divide(14, 4, "heads")
    _fake_tp(monkeypatch, 0, 3)
    with pytest.raises(ValueError, match="num_attention_heads / tp_size: 4 .* 3"):
        QKVParallelLinear(64, 16, 4, 2)


# -------------------------------------------------------------- PP split ----

def test_pp_layer_range() -> None:
    assert [get_pp_layer_range(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [get_pp_layer_range(7, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 7)]
    assert [get_pp_layer_range(8, r, 3) for r in range(3)] == [(0, 2), (2, 5), (5, 8)]
    assert get_pp_layer_range(5, 0, 1) == (0, 5)
    assert [get_pp_layer_range(4, r, 2, [1, 3]) for r in range(2)] == [(0, 1), (1, 4)]


def test_pp_layer_range_errors() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 .* num_hidden_layers 2"):
        get_pp_layer_range(2, 0, 3)
    with pytest.raises(ValueError, match="partition"):
        get_pp_layer_range(4, 0, 2, [2, 1])
    with pytest.raises(ValueError, match="pp_rank"):
        get_pp_layer_range(4, 2, 2)


def _stage(path: str, monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> torch.nn.Module:
    monkeypatch.setattr(state, "pp_rank", lambda: rank)
    monkeypatch.setattr(state, "pp_size", lambda: size)
    monkeypatch.setattr(state, "is_first_pp_rank", lambda: rank == 0)
    monkeypatch.setattr(state, "is_last_pp_rank", lambda: rank == size - 1)
    return load_model(path, load_hf_config(path), torch.float32, "cpu")


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
def test_pp_stages_chain_to_hf_logits(ckpts: dict[str, str], family: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path, ids, pos = ckpts[family], _ids(), torch.arange(T)
    first = _stage(path, monkeypatch, 0, 2)
    last = _stage(path, monkeypatch, 1, 2)
    assert isinstance(first.model.layers[1], PPMissingLayer)
    assert isinstance(first.lm_head, PPMissingLayer) and isinstance(last.model.embed_tokens,
                                                                     PPMissingLayer)
    assert len(find_attention_layers(first)) == len(find_attention_layers(last)) == 1
    with torch.no_grad():
        mid = first(ids, pos)
        assert isinstance(mid, IntermediateTensors) and set(mid) == {"hidden_states", "residual"}
        logits = last.compute_logits(last(ids, pos, mid))
    assert (logits - _hf_logits(path, ids)).abs().max().item() < 1e-4


# -------------------------------------------- real TP=2 x PP=2 over gloo ----

def _tp2pp2_worker(rank: int, path: str, rdv: str, out: str) -> None:
    torch.set_num_threads(1)
    state.init_distributed(4, rank, tp_size=2, pp_size=2, init_method=f"file://{rdv}",
                           backend="gloo", timeout_s=60)
    try:
        model = load_model(path, load_hf_config(path), torch.float32, "cpu")
        ids, pos = _ids(vocab=511), torch.arange(T)
        probe = {"i": torch.arange(6).view(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
                 "empty": torch.zeros(0, 4)}
        with torch.no_grad():
            if state.is_first_pp_rank():
                send_tensor_dict(model(ids, pos), state.pp_next_rank())
                send_tensor_dict(probe, state.pp_next_rank())
                return
            logits = model.compute_logits(model(ids, pos, recv_tensor_dict(state.pp_prev_rank())))
            got = recv_tensor_dict(state.pp_prev_rank())
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in probe.items())
        torch.save(logits, f"{out}.{state.tp_rank()}")
    finally:
        state.destroy_distributed()


def test_tp2_pp2_gloo_matches_hf(tmp_path: Path) -> None:
    # vocab 511 exercises the padded, masked vocab-parallel embedding and lm_head.
    path = make_tiny_model("qwen3", tmp_path / "m", vocab_size=511, num_hidden_layers=3)
    out = str(tmp_path / "logits")
    mp.spawn(_tp2pp2_worker, args=(path, str(tmp_path / "rdv"), out), nprocs=4, join=True)
    ref = _hf_logits(path, _ids(vocab=511))
    for tp_rank in range(2):  # both TP ranks of the last stage hold the full logits
        logits = torch.load(f"{out}.{tp_rank}")
        assert logits.shape == (T, 511)
        assert (logits - ref).abs().max().item() < 1e-4


def test_onednn_linear_buckets_rows_and_matches_f_linear():
    """Row counts above 64 are padded to a bounded set of shapes (oneDNN keeps
    memory per distinct shape), and the padded product equals F.linear's."""
    import torch.nn.functional as F

    from conveyor.kernels import cpu_linear
    from conveyor.parallel.layers import linear, onednn_rows

    assert [onednn_rows(m) for m in (1, 64, 65, 80, 81, 256, 257, 2048)] == [1, 64, 80, 80, 96, 256, 320, 2048]
    assert len({onednn_rows(m) for m in range(1, 2049)}) == 64 + 12 + 28
    assert all(m <= onednn_rows(m) <= 1.25 * m for m in range(1, 2049))
    mod = torch.nn.Module()
    w, b = torch.randn(96, 40), torch.randn(96)
    for m in (3, 65, 300):
        x = torch.randn(m, 40)
        y = linear(mod, x, w, b)
        assert y.shape == (m, 96)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # bf16 above 256 rows: packed on a CPU without AMX, F.linear with AMX; same product.
    from conveyor.parallel import layers

    bmod, wb, bb = torch.nn.Module(), w.bfloat16(), b.bfloat16()
    xb = torch.randn(300, 40).bfloat16()
    y = linear(bmod, xb, wb, bb)
    assert y.shape == (300, 96) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(xb, wb, bb).float(), rtol=2e-2, atol=2e-2)
    packed = torch.bfloat16 in layers._PACKED_DTYPES and not cpu_linear.amx()
    assert ("_packed_weight" in bmod.__dict__) == packed


def test_bf16_linear_without_onednn_bf16_runs_fp32_math(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN has no bf16 kernels (AVX2: emulated by dropping bf16 from
    the packed dtypes), a bf16 linear above the small kernel's rows runs fp32
    oneDNN over an fp32 packed copy: bit for bit that product rounded once to
    bf16; a reloaded weight is packed again."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    from conveyor.parallel import layers

    monkeypatch.setattr(layers, "_PACKED_DTYPES", (torch.float32,))
    g = torch.Generator().manual_seed(11)
    mod, w, b = torch.nn.Module(), torch.randn(96, 40, generator=g).bfloat16(), torch.randn(96, generator=g)
    for m in (17, 65, 300):
        x = torch.randn(m, 40, generator=g).bfloat16()
        y = layers.linear(mod, x, w, b.bfloat16())
        packed = torch.ops.mkldnn._reorder_linear_weight(w.float(), None)
        rows = layers.onednn_rows(m)
        want = torch.ops.mkldnn._linear_pointwise(torch.nn.functional.pad(x.float(), (0, 0, 0, rows - m)), packed,
                                                  b.bfloat16().float(), "none", [None], "")[:m]
        assert y.dtype == torch.bfloat16 and torch.equal(y, want.to(torch.bfloat16)), m
    assert "_packed_weight_f32" in mod.__dict__ and "_packed_weight" not in mod.__dict__
    w.mul_(2)  # in place, as a reload: the fp32 copy follows the weight's version
    x = torch.randn(20, 40, generator=g).bfloat16()
    want = torch.ops.mkldnn._linear_pointwise(x.float(), torch.ops.mkldnn._reorder_linear_weight(w.float(), None),
                                              None, "none", [None], "")
    assert torch.equal(layers.linear(mod, x, w, None), want.to(torch.bfloat16))
