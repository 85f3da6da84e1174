"""accelerate's ``parallelism_config`` (issue 26): dp_replicate x dp_shard is hybrid sharding, tp/cp are refused.

Default suite (cheap):

* in this process: the variables accelerate's own launcher code exports for a yaml ``parallelism_config``
  block and for the ``--parallelism_config_*`` flags, and ``Accelerator(parallelism_config=...)``, for
  fsdp_version 1 and 2: tensor / context parallelism stop at ``Accelerator()`` with the named error; the
  sizes become shard groups; contradicting settings are named.
* (marked ``ci``: CI runs it, ``make test`` does not) one real launch with ``parallelism_config_tp_size: 2``
  in the yaml: it fails within seconds, naming it (the refusal itself is the in-process case above).
* 4 spawned gloo ranks, five Accelerators in turn: 2 x 2 (FSDP2 keys, sizes in code) has the groups of
  HYBRID_SHARD with FLATSHARD_FSDP_GROUP_SIZE=2 (fsdp_version 1) and of accelerate's mesh; accelerate reports the
  layout (``parallelism_config``, ``torch_device_mesh``; the data split is DDP's); a plain loop with
  accumulation and clipping equals one process on the same global batch; SHARDED ``save_state`` holds one
  shard per shard-group rank; resumed at 1 x 4 (fsdp_version 1, sizes from PARALLELISM_CONFIG_* as the
  launcher exports them) the state is bit-identical and the next steps equal the reference; 4 x 1
  replicates (unsharded, warned, DDP semantics); sizes that do not multiply to W get accelerate's error.

``slow``: real launches against accelerate's DDP: the plain script with the shipped
accelerate_configs/cpu_4proc_fsdp2_hsdp.yaml vs DDP W=4 and its checkpoint resumed at 1 x 2 vs DDP resumed
at W=2; dp_shard 2 at W=2 vs DDP W=2; the Trainer at 2 x 2 vs DDP W=4.
"""
from __future__ import annotations

import functools
import json
import os
import re
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from dist_helpers import spawn
from launch_helpers import PLAIN_SCRIPT, REPO, SCRIPTS, DDP_CONFIG, launch, max_abs_diff, read_json
from toy import D, Toy

pytest.importorskip("accelerate")
from accelerate import ParallelismConfig  # noqa: E402

from accel_flatshard.integrations import config as cfg  # noqa: E402

FSDP1_YAML = REPO / "accelerate_configs" / "cpu_2proc.yaml"
FSDP2_YAML = REPO / "accelerate_configs" / "cpu_2proc_fsdp2.yaml"
HSDP_YAML = REPO / "accelerate_configs" / "cpu_4proc_fsdp2_hsdp.yaml"
_PREFIXES = ("FSDP_", "FLATSHARD_", "ACCELERATE_", "PARALLELISM_CONFIG_")
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}
FSDP1_ENV = dict(FSDP_ENV, FSDP_VERSION="1")
FSDP2_ENV = dict(FSDP_ENV, FSDP_VERSION="2")
STEPS, ACCUM, GLOBAL_MICRO, CLIP, LR = 4, 2, 8, 0.05, 1e-2
PLAIN_CLIP = 0.3  # tests/scripts/plain_accelerate_train.py --max_grad_norm (its norms at W=4 stay above it)
REFUSAL = "{kind} parallelism (parallelism_config_{dim}_size=2) is not supported by accel_flatshard; remove it"


# ---------------------------------------------------------------------- in this process
@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(_PREFIXES):
            monkeypatch.delenv(key)
    return monkeypatch


def _launcher_env(*argv: str) -> dict:
    """What ``accelerate launch ARGV train.py`` exports to the processes (accelerate's own code)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = _validate_launch_command(launch_command_parser().parse_args([*map(str, argv), "train.py"]))[0]
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(_PREFIXES)}


def _yaml_with(directory: Path, base: Path, num_processes: int = 2, **sizes: int) -> Path:
    config = yaml.safe_load(base.read_text())
    config["num_processes"] = num_processes
    config["parallelism_config"] = {f"parallelism_config_{k}_size": v for k, v in sizes.items()}
    path = directory / f"{base.stem}_{'_'.join(f'{k}{v}' for k, v in sizes.items())}_w{num_processes}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _path_env_and_kwargs(path: str, version: int, dim: str, tmp_path: Path):
    base = FSDP2_YAML if version == 2 else FSDP1_YAML
    if path == "yaml":
        return _launcher_env("--config_file", _yaml_with(tmp_path, base, **{dim: 2})), {}
    if path == "flags":
        return _launcher_env("--config_file", base, "--use_fsdp", "--fsdp_version", version,
                             "--use_parallelism_config", f"--parallelism_config_{dim}_size", 2), {}
    return dict(FSDP_ENV, FSDP_VERSION=str(version)), {"parallelism_config": ParallelismConfig(**{f"{dim}_size": 2})}


@pytest.mark.parametrize("dim, kind", [("tp", "tensor"), ("cp", "context")])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("path", ["yaml", "flags", "code"])
def test_tensor_and_context_parallelism_stop_at_accelerator_with_the_named_error(clean_env, tmp_path, path,
                                                                                 version, dim, kind):
    from accel_flatshard.integrations.accelerate import Accelerator

    env, kwargs = _path_env_and_kwargs(path, version, dim, tmp_path)
    assert env["FSDP_VERSION"] == str(version)
    assert path == "code" or env[f"PARALLELISM_CONFIG_{dim.upper()}_SIZE"] == "2"  # the launcher passes it on
    for key, value in env.items():
        clean_env.setenv(key, value)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=re.escape(REFUSAL.format(kind=kind, dim=dim))):
        Accelerator(**kwargs)
    assert time.perf_counter() - start < 5


def test_deprecated_tp_plugin_is_refused_too(clean_env):
    from accelerate.utils import TorchTensorParallelPlugin

    from accel_flatshard.integrations.accelerate import Accelerator

    for key, value in FSDP2_ENV.items():
        clean_env.setenv(key, value)
    with pytest.raises(ValueError, match=re.escape(REFUSAL.format(kind="tensor", dim="tp"))):
        Accelerator(torch_tp_plugin=TorchTensorParallelPlugin(tp_size=2))


def _options(monkeypatch, env: dict, parallelism=None):
    from accelerate.utils import FullyShardedDataParallelPlugin

    for key in [k for k in os.environ if k.startswith(_PREFIXES)]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = cfg.build_plugin_without_device(FullyShardedDataParallelPlugin)
    return cfg.options_from_plugin(plugin, parallelism=parallelism)


def test_sizes_from_the_shipped_yaml_and_flags_become_shard_groups(clean_env):
    """The shipped yaml's block (2 x 2), overridden by launch flags (1 x 4), as accelerate's launcher passes it."""
    for argv, (replicate, shard) in {(): (2, 2), ("--parallelism_config_dp_replicate_size", 1,
                                               "--parallelism_config_dp_shard_size", 4): (1, 4)}.items():
        env = _launcher_env("--config_file", HSDP_YAML, *argv)
        for key, value in env.items():
            clean_env.setenv(key, value)
        pc = cfg.requested_parallelism_config({})
        assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size) == (replicate, shard, 1, 1)
        opts = _options(clean_env, env, pc)
        assert (opts.fsdp_group_size, opts.reshard_after_forward) == (shard, True)
    # HYBRID_SHARD with FLATSHARD_FSDP_GROUP_SIZE=2 (fsdp_version 1) asks for the same groups
    hybrid = _options(clean_env, dict(FSDP1_ENV, FSDP_SHARDING_STRATEGY="HYBRID_SHARD", FLATSHARD_FSDP_GROUP_SIZE="2"))
    assert hybrid.fsdp_group_size == 2 and hybrid.reshard_after_forward


def test_contradicting_layouts_are_named(clean_env):
    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    with pytest.raises(ValueError, match="FLATSHARD_FSDP_GROUP_SIZE=4 disagrees with parallelism_config_dp_shard_size=2"):
        _options(clean_env, dict(FSDP1_ENV, FSDP_SHARDING_STRATEGY="HYBRID_SHARD", FLATSHARD_FSDP_GROUP_SIZE="4"), pc)
    with pytest.raises(ValueError, match="NO_SHARD contradicts parallelism_config_dp_shard_size=2"):
        _options(clean_env, dict(FSDP1_ENV, FSDP_SHARDING_STRATEGY="NO_SHARD"), pc)
    # _HYBRID_SHARD_ZERO2 keeps its "no reshard after forward" with the config's groups
    zero2 = _options(clean_env, dict(FSDP1_ENV, FSDP_SHARDING_STRATEGY="_HYBRID_SHARD_ZERO2"), pc)
    assert (zero2.fsdp_group_size, zero2.reshard_after_forward) == (2, False)


@pytest.mark.ci
def test_tp_in_the_yaml_stops_a_real_launch_within_seconds(tmp_path):
    config = _yaml_with(tmp_path, FSDP2_YAML, dp_shard=1, tp=2)
    start = time.perf_counter()
    proc = launch(config, PLAIN_SCRIPT, ["--output_json", str(tmp_path / "never.json")], via_run=True,
                  check=False, timeout=180)
    wall = time.perf_counter() - start
    assert proc.returncode != 0 and not (tmp_path / "never.json").exists()
    assert REFUSAL.format(kind="tensor", dim="tp") in proc.stderr, proc.stderr[-3000:]
    assert wall < 90, wall  # imports of 2 processes on a loaded 2-core host; the check itself is instant


# ---------------------------------------------------------------------- spawned gloo ranks
def _data(n: int) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(3))


def _accelerator(env: dict, **kwargs):
    """A new accel_flatshard Accelerator in this process, as if it were the first (env = the launcher's)."""
    from accelerate.state import AcceleratorState, GradientState

    from accel_flatshard.integrations.accelerate import Accelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    for key in [k for k in os.environ if k.startswith(_PREFIXES)]:
        del os.environ[key]
    os.environ.update(env)
    return Accelerator(gradient_accumulation_steps=ACCUM, **kwargs)


def _prepared(accelerator, steps: int, seed: int = 0):
    from torch.utils.data import DataLoader, TensorDataset

    model = Toy(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    per_rank = GLOBAL_MICRO // accelerator.num_processes
    loader = DataLoader(TensorDataset(_data(steps * ACCUM * GLOBAL_MICRO)), batch_size=per_rank)
    return accelerator.prepare(model, optimizer, loader)


def _train(accelerator, model, optimizer, loader, save_at=None, save_dir=None):
    """The plain accelerate loop: accumulate, backward, clip on the sync step; global-mean losses per step."""
    losses, norms, micro, saved = [], [], [], None
    for (x,) in loader:
        with accelerator.accumulate(model):
            loss = model(x)
            micro.append(accelerator.gather(loss.detach()).mean().item())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses.append(sum(micro) / len(micro))
            micro = []
            if len(losses) == save_at:
                accelerator.save_state(save_dir)
                saved = accelerator.get_state_dict(model)
    return losses, norms, saved


def _ranks(group) -> list:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)


def _groups(model) -> tuple:
    group = model.shard_group
    replicas = _ranks(group.replica_group) if group.replica_group is not None else None
    return _ranks(group.shard_group), replicas


def _layouts_worker(rank: int, world: int, save_dir: str) -> dict:
    """Five Accelerators in turn on the same 4 ranks (accelerate's state reset in between)."""
    out = {}
    hybrid = _accelerator(dict(FSDP1_ENV, FSDP_SHARDING_STRATEGY="HYBRID_SHARD", FLATSHARD_FSDP_GROUP_SIZE="2"))
    out["hybrid_groups"] = _groups(hybrid.prepare(Toy()))

    # 2 x 2 in code, fsdp_version 2: train, save_state after step 2
    accelerator = _accelerator(FSDP2_ENV, parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    pc, mesh = accelerator.parallelism_config, accelerator.torch_device_mesh
    out["layout"] = [pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size, pc.data_parallel_size]
    out["mesh"] = {"names": list(mesh.mesh_dim_names), "ranks": mesh.mesh.tolist(),
                   "dp_shard": _ranks(mesh["dp_shard"].get_group()),
                   "dp_replicate": _ranks(mesh["dp_replicate"].get_group())}
    out["ranks"] = [accelerator.num_processes, accelerator.data_parallel_rank, accelerator.data_parallel_shard_rank]
    model, optimizer, loader = _prepared(accelerator, STEPS)
    out["groups"] = _groups(model)
    out["local_numel"] = sum(p.numel() for p in model.parameters())
    out["first_batch"] = next(iter(loader))[0]
    out["losses"], out["norms"], out["saved"] = _train(accelerator, model, optimizer, loader, STEPS // 2, save_dir)

    # resumed at 1 x 4, fsdp_version 1, sizes as the launcher exports them for a yaml block
    launched = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
                "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4", "PARALLELISM_CONFIG_TP_SIZE": "1"}
    accelerator = _accelerator(dict(FSDP1_ENV, **launched))
    model, optimizer, loader = _prepared(accelerator, STEPS, seed=5)
    out["resumed_layout"] = [accelerator.parallelism_config.dp_replicate_size,
                             accelerator.parallelism_config.dp_shard_size, model.shard_group.shard_size]
    accelerator.load_state(save_dir)
    out["loaded"] = accelerator.get_state_dict(model)
    rest = accelerator.skip_first_batches(loader, STEPS // 2 * ACCUM)
    out["resumed_losses"], out["resumed_norms"], _ = _train(accelerator, model, optimizer, rest)

    # 4 x 1: replication
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replicated = ParallelismConfig(dp_replicate_size=4, dp_shard_size=1)
        accelerator = _accelerator(FSDP2_ENV, parallelism_config=replicated)
    out["warnings"] = [str(w.message) for w in caught]
    model, optimizer, loader = _prepared(accelerator, STEPS // 2)
    out["replicated_groups"] = _groups(model)
    out["replicated_numel"] = sum(p.numel() for p in model.parameters())
    out["replicated_losses"], out["replicated_norms"], _ = _train(accelerator, model, optimizer, loader)

    # last: when its check fails accelerate has built a 2-rank mesh on ranks 0 and 1 only (groups out of step)
    try:  # sizes that do not multiply to the world size: accelerate's own check
        _accelerator(FSDP2_ENV, parallelism_config=ParallelismConfig(dp_replicate_size=1, dp_shard_size=2))
    except ValueError as exc:
        out["size_error"] = str(exc)
    # ranks 2 and 3 fail before the mesh: wait here, or their exit resets 0 and 1's connections mid-mesh
    torch.distributed.barrier()
    return out


@functools.lru_cache(maxsize=None)
def _reference(steps: int):
    """One process, global micro-batches of GLOBAL_MICRO samples: losses, norms, state after steps // 2."""
    model = Toy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    micro_batches = _data(steps * ACCUM * GLOBAL_MICRO).split(GLOBAL_MICRO)
    losses, norms, saved = [], [], None
    for step in range(steps):
        total = 0.0
        for x in micro_batches[step * ACCUM:(step + 1) * ACCUM]:
            loss = model(x)
            (loss / ACCUM).backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / ACCUM)
        if step + 1 == steps // 2:
            saved = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, norms, saved


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("pcfg") / "ckpt"
    return save_dir, spawn(4, _layouts_worker, str(save_dir), timeout_s=300)


def test_2x2_groups_are_hybrid_shard_groups_and_accelerates_mesh(layouts):
    _, first = layouts
    for rank, out in enumerate(first):
        shard_ranks, replica_ranks = [2 * (rank // 2), 2 * (rank // 2) + 1], [rank % 2, rank % 2 + 2]
        assert out["groups"] == out["hybrid_groups"] == (shard_ranks, replica_ranks)
        assert out["mesh"] == {"names": ["dp_replicate", "dp_shard"], "ranks": [[0, 1], [2, 3]],
                               "dp_shard": shard_ranks, "dp_replicate": replica_ranks}
        assert out["layout"] == [2, 2, 1, 1, 4]
        assert out["ranks"] == [4, rank // 2, rank % 2]
        # the data split is DDP's at W=4: rank r reads the r-th slice of every global micro-batch
        assert torch.equal(out["first_batch"], _data(GLOBAL_MICRO)[2 * rank: 2 * rank + 2])
    total, local = sum(p.numel() for p in Toy().parameters()), [o["local_numel"] for o in first]
    assert local[0] + local[1] == total and local[:2] == local[2:]  # each replica: the model once, in halves
    assert "total_size (2) does not match num_processes (4)" in first[0]["size_error"]


def test_2x2_plain_loop_equals_one_process_and_saves_one_shard_per_group_rank(layouts):
    save_dir, first = layouts
    losses, norms, saved = _reference(STEPS)
    assert min(norms) > CLIP  # clipping is active on every step
    for out in first:
        assert max_abs_diff(out["losses"], losses) < 1e-5 and max_abs_diff(out["norms"], norms) < 1e-5
    assert saved.keys() == first[0]["saved"].keys()
    for key, value in saved.items():
        torch.testing.assert_close(first[0]["saved"][key], value, rtol=0, atol=1e-5)
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        meta = json.loads((save_dir / part / "flatshard.json").read_text())
        assert (meta["world_size"], meta["shard_size"]) == (4, 2)
        assert sorted(meta["files"]) == ["__0_0.distcp", "__1_0.distcp"]  # replica 1 wrote no tensor data


def test_2x2_checkpoint_resumes_at_1x4_exactly(layouts):
    _, runs = layouts
    losses, norms, _ = _reference(STEPS)
    assert runs[0]["resumed_layout"] == [1, 4, 4]
    assert runs[0]["saved"].keys() == runs[0]["loaded"].keys()
    for key, value in runs[0]["saved"].items():
        assert torch.equal(runs[0]["loaded"][key], value), key
    for out in runs:
        assert max_abs_diff(out["resumed_losses"], losses[STEPS // 2:]) < 1e-5
        assert max_abs_diff(out["resumed_norms"], norms[STEPS // 2:]) < 1e-5


def test_dp_shard_1_replicates_with_ddp_semantics_and_says_why(layouts):
    _, runs = layouts
    losses, norms, _ = _reference(STEPS // 2)
    total = sum(p.numel() for p in Toy().parameters())
    for rank, out in enumerate(runs):
        assert out["replicated_groups"] == ([rank], [0, 1, 2, 3])
        assert out["replicated_numel"] == total  # every rank holds everything
        assert any("dp_shard_size 1 x dp_replicate_size 4" in w and "DDP semantics" in w for w in out["warnings"])
        assert max_abs_diff(out["replicated_losses"], losses) < 1e-5
        assert max_abs_diff(out["replicated_norms"], norms) < 1e-5


# ---------------------------------------------------------------------- slow: real launches vs accelerate DDP
def _ddp_yaml(directory: Path, num_processes: int) -> Path:
    path = directory / f"ddp{num_processes}.yaml"
    path.write_text(yaml.safe_dump(dict(DDP_CONFIG, num_processes=num_processes)))
    return path


def _plain(directory: Path, name: str, config: Path, *args: str, ddp: bool = False) -> dict:
    out = directory / f"{name}.json"
    args = ["--output_json", str(out), "--max_grad_norm", str(PLAIN_CLIP), *args]
    launch(config, PLAIN_SCRIPT, args, via_run=not ddp, ddp=ddp, timeout=600)
    return read_json(out)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """DDP and accel_flatshard, W=4 (2 x 2, shipped yaml) with save_state at step 4, then both checkpoints
    resumed at W=2 (ours: 1 x 2 from a yaml block); dp_shard 2 at W=2 fresh, against DDP W=2."""
    work = tmp_path_factory.mktemp("pcfg_launch")
    save = lambda kind, d: ["--save_at", "4", "--save", f"{kind}={work / d}"]  # noqa: E731
    shard2 = _yaml_with(work, FSDP2_YAML, dp_shard=2)
    runs = {"ddp4": _plain(work, "ddp4", _ddp_yaml(work, 4), *save("X", "ddp4_ckpt"), ddp=True),
            "hsdp4": _plain(work, "hsdp4", HSDP_YAML, *save("SHARDED_STATE_DICT", "hsdp4_ckpt")),
            "ddp2": _plain(work, "ddp2", _ddp_yaml(work, 2), ddp=True),
            "shard2": _plain(work, "shard2", shard2, *save("SHARDED_STATE_DICT", "shard2_ckpt")),
            "ddp2_resumed": _plain(work, "ddp2_resumed", _ddp_yaml(work, 2), "--save_at", "4",
                                   "--resume_from", str(work / "ddp4_ckpt"), ddp=True),
            "shard2_resumed": _plain(work, "shard2_resumed", shard2, "--save_at", "4",
                                     "--resume_from", str(work / "hsdp4_ckpt"))}
    return work, runs


def _assert_plain_equal(ours: dict, ddp: dict, world: int, layout: list) -> None:
    assert ours["distributed_type"] == "DistributedType.FSDP" and ours["num_processes"] == ddp["num_processes"] == world
    assert ours["parallelism"] == layout
    assert ours["mesh_dims"] == [n for n, size in zip(("dp_replicate", "dp_shard"), layout) if size > 1]
    print(f"W={world} {layout}: losses {max_abs_diff(ours['losses'], ddp['losses']):.2e}, "
          f"grad norms {max_abs_diff(ours['grad_norms'], ddp['grad_norms']):.2e}")
    assert max_abs_diff(ours["losses"], ddp["losses"]) < 1e-5
    assert max_abs_diff(ours["grad_norms"], ddp["grad_norms"]) < 1e-5
    assert min(ddp["grad_norms"]) > PLAIN_CLIP  # clipping active on every step
    assert ours["eval"]["samples"] == ddp["eval"]["samples"] == 10


@pytest.mark.slow
def test_plain_script_2x2_yaml_equals_ddp_w4_and_saves_one_shard_per_group_rank(launched):
    work, runs = launched
    _assert_plain_equal(runs["hsdp4"], runs["ddp4"], 4, [2, 2, 1, 1])
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        meta = json.loads((work / "hsdp4_ckpt" / part / "flatshard.json").read_text())
        assert (meta["world_size"], meta["shard_size"]) == (4, 2)
        assert sorted(meta["files"]) == ["__0_0.distcp", "__1_0.distcp"]  # replica 1 wrote no tensor data


@pytest.mark.slow
def test_plain_script_dp_shard_2_equals_ddp_w2(launched):
    work, runs = launched
    _assert_plain_equal(runs["shard2"], runs["ddp2"], 2, [1, 2, 1, 1])
    meta = json.loads((work / "shard2_ckpt" / "pytorch_model_fsdp_0" / "flatshard.json").read_text())
    assert (meta["world_size"], meta["shard_size"], sorted(meta["files"])) == (2, 2, ["__0_0.distcp", "__1_0.distcp"])


@pytest.mark.slow
def test_2x2_checkpoint_resumed_at_1x2_equals_ddp_resumed_at_w2(launched):
    _, runs = launched
    ours, ddp = runs["shard2_resumed"]["resumed"][0], runs["ddp2_resumed"]["resumed"][0]
    assert len(ours["losses"]) == 4 and ours["counter_after_load"] == ddp["counter_after_load"] == 4
    print(f"resumed: losses {max_abs_diff(ours['losses'], ddp['losses']):.2e}")
    assert max_abs_diff(ours["losses"], ddp["losses"]) < 1e-5
    assert max_abs_diff(ours["grad_norms"], ddp["grad_norms"]) < 1e-5


@pytest.mark.slow
def test_trainer_2x2_equals_ddp_w4_with_the_same_global_batch(tmp_path):
    script = SCRIPTS / "trainer_causal_lm.py"
    results = {}
    for name, config, ddp in (("ddp", _ddp_yaml(tmp_path, 4), True), ("hsdp", HSDP_YAML, False)):
        out = tmp_path / name
        launch(config, script, ["--output_dir", str(out / "run"), "--output_json", str(out / "r.json"),
                                "--gradient_accumulation_steps", "2"], via_run=not ddp, ddp=ddp, timeout=600)
        results[name] = read_json(out / "r.json")
    ours, ddp = results["hsdp"], results["ddp"]
    assert ours["world_size"] == ddp["world_size"] == 4 and ours["distributed_type"] == "DistributedType.FSDP"
    assert ours["parallelism"] == [2, 2, 1, 1] and ours["global_batch"] == ddp["global_batch"] == 32
    assert ours["global_step"] == ddp["global_step"] == 8
    print(f"trainer: losses {max(abs(ours['losses'][s] - ddp['losses'][s]) for s in ddp['losses']):.2e}")
    assert ours["losses"].keys() == ddp["losses"].keys()
    assert max(abs(ours["losses"][s] - ddp["losses"][s]) for s in ddp["losses"]) < 1e-5
    total, local = ours["total_trainable_numel"], ours["local_trainable_numel"]
    assert local[0] + local[1] == total and local[:2] == local[2:]  # each replica: the model once, in halves
