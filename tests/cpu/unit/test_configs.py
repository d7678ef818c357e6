"""Every file under configs/ loads (engine YAMLs through the schema, Serve
YAMLs' import paths and engine configs, cluster launcher and KubeRay
manifests through a small structural schema), and every class of config
mistake fails at load time with the file, the key path and the expectation."""
from __future__ import annotations

import glob
import json
import os
import shlex
from typing import Any

import msgspec
import pytest
import yaml
from repo_paths import ROOT

from conveyor.engine.config import ConfigError, build_config, check_cluster_fits, load_config

CONFIGS = os.path.join(ROOT, "configs")


def _yaml(path: str) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


def _top_level(kind: str) -> list[str]:
    """configs/*.yaml split into engine configs and Serve configs."""
    files = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
    serve = [f for f in files if "applications" in (_yaml(f) or {})]
    return serve if kind == "serve" else [f for f in files if f not in serve]


# ---- the shipped files ---------------------------------------------------------------------

@pytest.mark.parametrize("path", _top_level("engine"), ids=os.path.basename)
def test_engine_configs_load_without_the_checkpoint(path):
    cfg = load_config(path)  # model paths are placeholders: nothing on disk is needed
    assert cfg.max_model_len >= 1 and cfg.world_size >= 1


def test_gpu_configs_are_what_their_names_say():
    shapes = {"llama3-8b-tp2.yaml": (2, 1), "llama3-70b-tp4-pp2.yaml": (4, 2), "qwen3-32b-tp4.yaml": (4, 1)}
    for name, (tp, pp) in shapes.items():
        cfg = load_config(os.path.join(CONFIGS, name))
        p = cfg.parallel
        assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.executor) == (tp, pp, "ray"), name
        assert cfg.model.dtype in ("bfloat16", "auto") and os.path.isabs(cfg.model.path)


def _check_serve_apps(apps: list[dict[str, Any]], where: str) -> list[Any]:
    """Import each app's import_path and load its engine config (+ overrides)."""
    import importlib

    configs = []
    assert isinstance(apps, list) and apps, where
    for app in apps:
        module, _, attr = app["import_path"].partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), where
        args = app.get("args") or {}
        configs.append(load_config(os.path.join(ROOT, args["config"]), **(args.get("overrides") or {})))
    return configs


@pytest.mark.parametrize("path", _top_level("serve"), ids=os.path.basename)
def test_serve_configs_import_and_load(path):
    doc = _yaml(path)
    assert isinstance(doc.get("http_options", {}), dict)
    assert _check_serve_apps(doc["applications"], path)


# ---- cluster launcher and KubeRay manifests: a small structural schema ---------------------------

def _require(doc: Any, schema: dict[str, Any], where: str = "") -> None:
    """schema: key -> type, or key -> nested schema (a dict). Keys ending in
    '?' are optional."""
    assert isinstance(doc, dict), f"{where or 'top level'}: expected a mapping"
    for key, want in schema.items():
        optional, key = key.endswith("?"), key.rstrip("?")
        if key not in doc:
            assert optional, f"{where}{key}: missing"
            continue
        if isinstance(want, dict):
            _require(doc[key], want, f"{where}{key}.")
        else:
            assert isinstance(doc[key], want), f"{where}{key}: expected {want}, got {type(doc[key])}"


def test_aws_cluster_launcher_config():
    doc = _yaml(os.path.join(CONFIGS, "cluster", "aws-gpu.yaml"))
    _require(doc, {"cluster_name": str, "max_workers": int, "provider": {"type": str, "region": str},
                   "auth": {"ssh_user": str}, "available_node_types": dict, "head_node_type": str,
                   "file_mounts": dict, "setup_commands": list, "head_start_ray_commands": list,
                   "worker_start_ray_commands": list})
    nodes = doc["available_node_types"]
    assert doc["head_node_type"] in nodes and doc["provider"]["type"] == "aws"
    for name, node in nodes.items():
        _require(node, {"node_config": {"InstanceType": str}, "resources": dict}, f"{name}.")
        if name != doc["head_node_type"]:
            _require(node, {"min_workers": int, "max_workers": int}, f"{name}.")
            assert 0 <= node["min_workers"] <= node["max_workers"] <= doc["max_workers"]
    commands = doc["setup_commands"] + doc["head_start_ray_commands"] + doc["worker_start_ray_commands"]
    assert all(isinstance(c, str) for c in commands)
    assert any("pip install" in c for c in doc["setup_commands"])  # installs the project
    assert any("ray start --head" in c for c in doc["head_start_ray_commands"])


_POD_GROUP = {"rayStartParams": dict, "template": {"spec": {"containers": list}}}


def _kuberay_cluster(spec: dict[str, Any], where: str) -> int:
    """Checks a RayCluster spec; returns the worker GPUs at `replicas`."""
    _require(spec, {"rayVersion": str, "headGroupSpec": _POD_GROUP, "workerGroupSpecs": list}, where)
    gpus = 0
    for i, group in enumerate(spec["workerGroupSpecs"]):
        _require(group, {"groupName": str, "replicas": int, "minReplicas": int, "maxReplicas": int,
                         **_POD_GROUP}, f"{where}workerGroupSpecs[{i}].")
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        for c in group["template"]["spec"]["containers"]:
            _require(c, {"name": str, "image": str, "resources": {"limits": dict}})
            gpus += int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) * group["replicas"]
    for c in spec["headGroupSpec"]["template"]["spec"]["containers"]:
        _require(c, {"name": str, "image": str})
    return gpus


def test_kuberay_rayservice():
    doc = _yaml(os.path.join(CONFIGS, "cluster", "rayservice.yaml"))
    _require(doc, {"apiVersion": str, "kind": str, "metadata": {"name": str},
                   "spec": {"serveConfigV2": str, "rayClusterConfig": dict}})
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    gpus = _kuberay_cluster(doc["spec"]["rayClusterConfig"], "spec.rayClusterConfig.")
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])  # a YAML document in a string
    for cfg in _check_serve_apps(serve_cfg["applications"], "serveConfigV2"):
        check_cluster_fits(cfg, gpus)  # one replica fits the worker group


def test_kuberay_rayjob():
    from conveyor.cluster.batch.job import ENGINE_AND_NAME, build_parser
    from conveyor.cluster.cli.options import collect_overrides

    doc = _yaml(os.path.join(CONFIGS, "cluster", "rayjob.yaml"))
    _require(doc, {"apiVersion": str, "kind": str, "metadata": {"name": str},
                   "spec": {"entrypoint": str, "runtimeEnvYAML?": str, "rayClusterSpec": dict,
                            "shutdownAfterJobFinishes?": bool}})
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    gpus = _kuberay_cluster(doc["spec"]["rayClusterSpec"], "spec.rayClusterSpec.")
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "conveyor.cluster.batch"]
    args = build_parser().parse_args(argv[3:])  # the batch job accepts the entrypoint's options
    cfg = load_config(os.path.join(ROOT, args.config), **collect_overrides(args, ENGINE_AND_NAME))
    check_cluster_fits(cfg, gpus, copies=args.data_parallel)
    assert isinstance(yaml.safe_load(doc["spec"]["runtimeEnvYAML"])["working_dir"], str)


def _locked() -> dict[str, str]:
    out = {}
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        for line in f:
            if "==" in line and not line.startswith("#"):
                name, version = line.strip().split("==")
                out[name.lower().replace("_", "-")] = version
    return out


def _runtime_env_pins() -> list[list[str]]:
    job = _yaml(os.path.join(CONFIGS, "cluster", "rayjob.yaml"))
    service = _yaml(os.path.join(CONFIGS, "cluster", "rayservice.yaml"))
    apps = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    return [yaml.safe_load(job["spec"]["runtimeEnvYAML"])["pip"], *(a["runtime_env"]["pip"] for a in apps)]


def test_kuberay_installs_are_the_lock_and_cover_the_runtime_dependencies():
    """The manifests' runtime_env pins the lock's versions, and every runtime dependency
    of pyproject.toml is there (ray itself comes with the image)."""
    import re
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    needed = {re.split(r"[\[<>=~!; ]", d)[0].lower().replace("_", "-") for d in deps} - {"ray"}
    locked = _locked()
    for pins in _runtime_env_pins():
        pinned = dict(p.split("==") for p in pins)
        assert needed <= set(pinned), needed - set(pinned)
        assert {n: v for n, v in pinned.items() if locked.get(n) != v} == {}, "refresh from constraints.txt"


# ---- config mistakes: file, key path, expectation ---------------------------------------------

def _write(tmp_path, tree: Any, name: str = "x.yaml") -> str:
    path = str(tmp_path / name)
    with open(path, "w") as f:
        f.write(tree if isinstance(tree, str) else yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize("tree, message", [
    # wrong types
    ({"scheduler": {"max_num_seqs": "ten"}}, 'scheduler.max_num_seqs: expected int >= 1, got "ten"'),
    ({"scheduler": {"enable_chunked_prefill": "yes"}},
     'scheduler.enable_chunked_prefill: expected bool, got "yes"'),
    ({"cache": {"gpu_memory_utilization": "most"}},
     'cache.gpu_memory_utilization: expected float in (0, 1], got "most"'),
    ({"parallel": 4}, "parallel: expected a mapping, got 4"),
    ({"serve": {"cors_origins": "*"}}, 'serve.cors_origins: expected a list, got "*"'),
    ({"parallel": {"pp_layer_partition": [1, "a"]}}, 'parallel.pp_layer_partition[1]: expected'),
    # unknown keys
    ({"scheduler": {"max_num_seq": 8}},
     "scheduler.max_num_seq: unknown key (did you mean 'max_num_seqs'?); expected one of max_num_seqs,"),
    ({"schedular": {}}, "schedular: unknown key (did you mean 'scheduler'?)"),
    # out of range / not one of the choices
    ({"scheduler": {"max_num_seqs": 0}}, "scheduler.max_num_seqs: expected int >= 1, got 0"),
    ({"model": {"dtype": "fp8"}}, 'model.dtype: expected one of float32/float16/bfloat16/auto, got "fp8"'),
    ({"cache": {"block_size": 12}}, "cache.block_size: expected one of 8/16/32/64/128, got 12"),
    ({"cache": {"gpu_memory_utilization": 1.5}}, "cache.gpu_memory_utilization: expected float in (0, 1], got 1.5"),
    ({"serve": {"port": 70000}}, "serve.port: expected int in 1..65535, got 70000"),
    ({"parallel": {"executor": "slurm"}}, 'parallel.executor: expected one of uniproc/ray/mp, got "slurm"'),
    # inconsistent combinations
    ({"scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 32}},
     "scheduler.max_num_batched_tokens: expected int >= scheduler.max_num_seqs (64), got 32"),
    ({"model": {"max_model_len": 4096}, "scheduler": {"enable_chunked_prefill": False,
                                                      "max_num_batched_tokens": 2048}},
     "scheduler.max_num_batched_tokens: expected int >= max_model_len (4096) when "
     "scheduler.enable_chunked_prefill is false"),
    ({"parallel": {"pipeline_parallel_size": 2, "pp_layer_partition": [1, 2, 3]}},
     "parallel.pp_layer_partition: expected a list of parallel.pipeline_parallel_size (2) layer counts, "
     "got [1, 2, 3]"),
])
def test_config_mistakes_name_file_key_and_expectation(tmp_path, tree, message):
    path = _write(tmp_path, tree)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_the_brief_example_verbatim(tmp_path):
    os.makedirs(tmp_path / "configs")
    path = _write(tmp_path, {"scheduler": {"max_num_seqs": "ten"}}, "configs/x.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f'{path}: scheduler.max_num_seqs: expected int >= 1, got "ten"'


def test_file_level_mistakes(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = _write(tmp_path, "model: {path: x\nscheduler: [", "bad.yaml")
    with pytest.raises(ConfigError, match=r"bad\.yaml:2:10: invalid YAML: expected ',' or '}', but got ':'"):
        load_config(bad)
    lst = _write(tmp_path, "- a\n- b\n", "list.yaml")
    with pytest.raises(ConfigError, match=r"list\.yaml: top level: expected a mapping of sections, got list"):
        load_config(lst)


def test_checkpoint_limits_apply_when_the_checkpoint_is_there(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert build_config(model=str(ckpt)).max_model_len == 512
    with pytest.raises(ConfigError, match=r"model\.max_model_len: expected int <= the checkpoint's "
                                          r"max_position_embeddings \(512\), got 1024"):
        build_config(model=str(ckpt), max_model_len=1024)
    # Not there (yet): loading works and uses the configured value or the default.
    assert build_config(model=str(tmp_path / "missing"), max_model_len=1024).max_model_len == 1024
    assert build_config(model=str(tmp_path / "missing")).max_model_len == 2048


def test_overrides_are_validated_and_marked(tmp_path):
    path = _write(tmp_path, {"scheduler": {"max_num_seqs": 8}})
    assert load_config(path, **{"serve.port": 8001, "scheduler.policy": "priority"}).serve.port == 8001
    with pytest.raises(ConfigError, match=r'serve\.port: expected int in 1\.\.65535, got "x" \(from an override\)'):
        load_config(path, **{"serve.port": "x"})
    with pytest.raises(ConfigError, match=r"serve\.prot: unknown key \(did you mean 'port'\?\)"):
        load_config(path, **{"serve.prot": 1})
    with pytest.raises(ConfigError, match="unknown engine argument 'bogus'"):
        load_config(path, bogus=1)


def test_parallel_size_must_fit_the_cluster():
    cfg = build_config(executor="ray", tensor_parallel_size=4, pipeline_parallel_size=2)
    check_cluster_fits(cfg, 8)
    check_cluster_fits(cfg, 0)  # a CPU cluster: workers take CPU bundles, not checked here
    with pytest.raises(ConfigError, match=r"c\.yaml: parallel: expected at most the cluster's 4 GPUs, got "
                                          r"tensor_parallel_size × pipeline_parallel_size = 4 × 2 = 8"):
        check_cluster_fits(cfg, 4, source="c.yaml")
    with pytest.raises(ConfigError, match=r"× 2 data-parallel engines = 16"):
        check_cluster_fits(cfg, 8, copies=2)


def test_each_knob_is_declared_once_and_drives_kwargs_and_cli():
    """The LLM keywords and the CLI options come from the fields' own knobs,
    so they cannot drift from the struct (the old hand list omitted cpu)."""
    from conveyor.cluster.cli.options import ENGINE_OVERRIDES, SERVE_OVERRIDES
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.config.build import _KNOBS, _KWARG_MAP

    flags = {o.flag: o for o in ENGINE_OVERRIDES + SERVE_OVERRIDES}
    assert "cpu" in flags["--attention-backend"].help
    assert flags["--enable-prefix-caching"].type("false") is False
    assert all(o.key.startswith("serve.") for o in SERVE_OVERRIDES)
    assert {o.key for o in ENGINE_OVERRIDES if o.key.startswith("serve.")} == {"serve.router"}
    default = EngineConfig()
    for kwarg, (section, field) in _KWARG_MAP.items():
        value = getattr(getattr(default, section), field)
        if value is not None and kwarg != "model":
            cfg = build_config(**{kwarg: value})
            assert getattr(getattr(cfg, section), field) == value
    # Every field of every section has a rule, except free-form lists.
    for section in msgspec.structs.fields(EngineConfig):
        for f in msgspec.structs.fields(section.type):
            assert f"{section.name}.{f.name}" in _KNOBS or f.name == "cors_origins", f.name
