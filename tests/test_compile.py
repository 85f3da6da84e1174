"""torch.compile with sharding (issue 24): compiled units train like DDP compiled the same way.

Reference: torch DDP with the same compilation (each block compiled in place with ``module.compile()``,
or the whole DDP model), same data, W=2 gloo ranks, inductor (C++ on CPU).  Dynamo's counters
(``accel_flatshard.core._compat.dynamo_counters``) are read after every step: no graph is compiled after the
first step, and the only graph breaks are at the units' gather/free hooks (none with regional compile).

Default: one in-process run shared by two tests (DDP with compiled blocks as the reference; ours regional
with no_sync + clipping + FULL and SHARDED save/load + gather-once generation; ours whole-model), bf16 +
activation checkpointing, the eager fall-back warning, and one ``accelerate launch`` pair (README yaml +
``dynamo_backend: INDUCTOR``, regional, save_state FULL and SHARDED).  ``slow``: W=4 and whole-model
launches, the resume launch, the Trainer with ``torch_compile=True``.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import yaml

from dist_helpers import spawn
from models import batches, llama, llama_layer_class

STEPS = 8
TOL = 1e-5


def _fresh_dynamo():
    from accel_flatshard.core._compat import dynamo_counters

    torch._dynamo.reset()
    dynamo_counters().clear()
    return dynamo_counters()


def _model(use_cache: bool = False):
    model = llama(n_layer=2, hidden=32)
    model.config.use_cache = use_cache
    return model


def _train(model, opt, rank, world, steps, first=0, clip=None):
    """``steps`` optimizer steps of 2 micro-batches (the first under no_sync), clipping at 0.5; the mean
    loss over ranks, the grad norm and dynamo's compiled-graph count after each step."""
    from accel_flatshard.core._compat import dynamo_counters

    data = batches(2 * (first + steps), batch=2 * world)[2 * first:]
    losses, norms, graphs = [], [], []
    for s in range(steps):
        total = 0.0
        for micro in range(2):
            x = data[2 * s + micro][2 * rank: 2 * rank + 2]
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                loss = model(input_ids=x, labels=x).loss / 2
                loss.backward()
            total += loss.item()
        norm = clip(0.5) if clip else model.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        mean = torch.tensor(total)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        norms.append(float(norm))
        graphs.append(dynamo_counters()["stats"]["unique_graphs"])
    return losses, norms, graphs


def _ddp(regional: bool, backend: str = "inductor"):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    if regional:
        for block in model.model.layers:
            block.compile(backend=backend)
    ddp = DDP(model)
    if not regional:
        ddp.compile(backend=backend)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    return ddp, opt, functools.partial(torch.nn.utils.clip_grad_norm_, list(ddp.parameters()))


def _ours(regional, backend="inductor", **kwargs):
    """Our wrapper (blocks as units), compiled with ``compile_model`` unless ``regional`` is None."""
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
    from accel_flatshard.features.compilation import compile_model

    model = _model()
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **kwargs)
    if regional is not None:
        compile_model(wrapped, regional=regional, backend=backend)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=3e-3)


def _our_warnings(caught):
    return [str(w.message) for w in caught if "accel_flatshard" in str(w.message)]


def _breaks(counters):
    return [k.split("Developer debug context:")[-1].strip().split("\n")[0] for k in counters["graph_break"]]


# ---------------------------------------------------------------------------- regional and whole model
def _placements_worker(rank, world, tmp):
    """DDP with compiled blocks (the reference), ours regional (with FULL / SHARDED save and load and
    generation), ours whole-model (aot_eager: dynamo + aot_autograd as with inductor, without the C++
    compile; whole-model inductor against DDP whole-model: the slow launch matrix)."""
    from accel_flatshard import state as ckpt, state as sd

    prompt = batches(1, batch=1, seq=4)[0]
    _fresh_dynamo()
    ddp, opt, clip = _ddp(regional=True)
    ref = _train(ddp, opt, rank, world, STEPS, clip=clip)
    ddp.eval()
    ref_tokens = ddp.module.generate(prompt, max_new_tokens=2, do_sample=False).tolist()
    del ddp, opt

    counters = _fresh_dynamo()
    model, opt = _ours(regional=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _train(model, opt, rank, world, 4)
        full = (sd.full_state_dict(model, rank0_only=False), sd.full_optim_state_dict(model, opt, rank0_only=False))
        ckpt.save_sharded_model(model, f"{tmp}/model")
        ckpt.save_sharded_optimizer(model, opt, f"{tmp}/optim")
        second = _train(model, opt, rank, world, STEPS - 4, first=4)
        sd.load_full_state_dict(model, full[0])
        sd.load_full_optim_state_dict(model, opt, full[1])
        from_full = _train(model, opt, rank, world, STEPS - 4, first=4)
        ckpt.load_sharded_model(model, f"{tmp}/model")
        ckpt.load_sharded_optimizer(model, opt, f"{tmp}/optim")
        from_sharded = _train(model, opt, rank, world, STEPS - 4, first=4)
        breaks = _breaks(counters)
        model.eval()
        tokens = model.module.generate(prompt, max_new_tokens=2, do_sample=False).tolist()
    regional = dict(ours=[a + b for a, b in zip(first, second)], from_full=from_full, from_sharded=from_sharded,
                    breaks=breaks, tokens=tokens, warnings=_our_warnings(caught))
    del model, opt

    counters = _fresh_dynamo()
    model, opt = _ours(regional=False, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole = dict(ours=_train(model, opt, rank, world, STEPS), breaks=_breaks(counters),
                     warnings=_our_warnings(caught))
    return dict(ref=ref, ref_tokens=ref_tokens, regional=regional, whole=whole)


@pytest.fixture(scope="module")
def placements(tmp_path_factory):
    return spawn(2, _placements_worker, str(tmp_path_factory.mktemp("compile")), timeout_s=900)[0]


def test_regional_compile_matches_ddp_without_recompiles_or_graph_breaks(placements):
    """Each block's forward compiled inside its unit's hooks: DDP's losses and grad norms (no_sync,
    clipping) within 1e-5; no graph compiled after step 1 (also not across FULL and SHARDED loads into
    the compiled model, whose replays of steps 5-8 are exact); no graph break at all; no unit eager;
    gather-once generation through the compiled blocks gives DDP's tokens."""
    (ref_loss, ref_norm, _), r = placements["ref"], placements["regional"]
    loss, norm, graphs = r["ours"]
    assert max(abs(a - b) for a, b in zip(loss, ref_loss)) < TOL, (loss, ref_loss)
    assert max(abs(a - b) for a, b in zip(norm, ref_norm)) < TOL and min(ref_norm) > 0.5  # clipping active
    assert graphs[0] > 0 and graphs == [graphs[0]] * STEPS, graphs  # compiled in step 1, never again
    for replay in (r["from_full"], r["from_sharded"]):
        assert replay[0] == loss[4:] and replay[1] == norm[4:]
        assert replay[2] == [graphs[0]] * (STEPS - 4)
    assert r["breaks"] == [] and r["warnings"] == []
    assert r["tokens"] == placements["ref_tokens"]


def test_whole_model_compile_breaks_only_at_unit_hooks(placements):
    """``model.compile()`` of the wrapper: the compiled DDP's losses within 1e-5; the graph breaks are all
    at the units' dynamo-disabled hooks (unit boundaries); nothing compiled after step 1; no unit eager."""
    (ref_loss, ref_norm, _), r = placements["ref"], placements["whole"]
    loss, norm, graphs = r["ours"]
    assert max(abs(a - b) for a, b in zip(loss, ref_loss)) < TOL, (loss, ref_loss)
    assert max(abs(a - b) for a, b in zip(norm, ref_norm)) < TOL
    assert graphs[0] > 0 and graphs == [graphs[0]] * STEPS, graphs
    assert r["breaks"] and all(("<function Unit." in b or "<function Schedule." in b) for b in r["breaks"]), r["breaks"]
    assert r["warnings"] == []


# ---------------------------------------------------------------------------- bf16 + activation checkpointing
def _features_worker(rank, world):
    from accel_flatshard import MixedPrecision
    from accel_flatshard.core.wrap import checkpoint_units

    results = {}
    for compiled in (False, True):
        counters = _fresh_dynamo()
        model, opt = _ours(True if compiled else None, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        # accelerate's fsdp_activation_checkpointing (the order does not matter)
        checkpoint_units(model.module, [u.module for u in model.units if not u.is_root])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[compiled] = _train(model, opt, rank, world, 4)
        results[f"breaks{compiled}"] = _breaks(counters)
        results[f"warnings{compiled}"] = _our_warnings(caught)
    return results


def test_bf16_and_activation_checkpointing_compiled():
    """bf16 compute (fp32 masters) and checkpointed blocks, compiled: the eager run's losses within bf16
    rounding (inductor keeps fused intermediates in fp32), no recompiles, no graph breaks."""
    r = spawn(2, _features_worker, timeout_s=900)[0]
    (eager_loss, _, _), (loss, _, graphs) = r[False], r[True]
    assert max(abs(a - b) for a, b in zip(loss, eager_loss)) < 5e-3, (loss, eager_loss)
    assert graphs == [graphs[0]] * 4 and graphs[0] > 0
    assert r["breaksTrue"] == [] and r["warningsTrue"] == []


# ---------------------------------------------------------------------------- no silent eager fall-back
def _recompile_limit_worker(rank, world):
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
    from accel_flatshard.features.compilation import compile_model

    _fresh_dynamo()
    model = _model(use_cache=True)  # HF's default: the KV cache makes each layer's index a graph constant
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    compile_model(wrapped, regional=True, backend="eager")  # dynamo's guards only: fast
    x = batches(1)[0]
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            wrapped(input_ids=x, labels=x).loss.backward()
    return _our_warnings(caught)


def test_unit_running_eagerly_warns_once_with_the_fix():
    """Blocks that recompile per layer past dynamo's limit run eagerly: one warning names the class, the
    cause and the fix (use_cache=False) instead of dynamo's silent fall-back."""
    (messages,) = spawn(1, _recompile_limit_worker, timeout_s=300)
    assert len(messages) == 1, messages
    cls = llama_layer_class().__name__
    assert f"{cls} runs eagerly" in messages[0] and "recompile limit" in messages[0]
    assert "use_cache=False" in messages[0]


# ---------------------------------------------------------------------------- accelerate launch
def _compile_yaml(tmp, name, regional, processes=2, ddp=False):
    from launch_helpers import DDP_CONFIG, REPO

    config = dict(DDP_CONFIG) if ddp else yaml.safe_load((REPO / "accelerate_configs" / "cpu_2proc_compile.yaml").read_text())
    config["num_processes"] = processes
    config["dynamo_config"] = {"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": regional}
    path = tmp / name
    path.write_text(yaml.safe_dump(config))
    return path


def _launch_pair(tmp, regional, processes=2, extra=()):
    """The plain accelerate script (llama, use_cache=False, 8 steps, accumulation 2, clipping) under
    accelerate's DDP and through ``-m accel_flatshard.run``, both with the same dynamo_config."""
    from launch_helpers import PLAIN_SCRIPT, launch, read_json

    tag = f"{'regional' if regional else 'whole'}{processes}"
    args = ["--model", "llama", "--no_cache"]
    launch(_compile_yaml(tmp, f"ddp_{tag}.yaml", regional, processes, ddp=True), PLAIN_SCRIPT,
           [*args, "--output_json", str(tmp / f"ddp_{tag}.json")], ddp=True, timeout=900)
    proc = launch(_compile_yaml(tmp, f"ours_{tag}.yaml", regional, processes), PLAIN_SCRIPT,
                  [*args, *extra, "--output_json", str(tmp / f"ours_{tag}.json")], via_run=True, timeout=900)
    return read_json(tmp / f"ddp_{tag}.json"), read_json(tmp / f"ours_{tag}.json"), proc


def _assert_like_ddp(ref, ours, proc, processes):
    from launch_helpers import max_abs_diff

    assert ours["distributed_type"] == "DistributedType.FSDP" and ours["num_processes"] == processes
    assert len(ours["losses"]) == STEPS
    assert max_abs_diff(ours["losses"], ref["losses"]) < TOL
    assert max_abs_diff(ours["grad_norms"], ref["grad_norms"]) < TOL
    assert abs(ours["eval"]["loss"] - ref["eval"]["loss"]) < TOL
    assert ours["dynamo_graphs"] > 0 and ref["dynamo_graphs"] > 0
    assert "runs eagerly" not in proc.stderr


@pytest.fixture(scope="module")
def compiled_launch(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile_launch")
    save = ["--save_at", "4", "--save", f"FULL_STATE_DICT={tmp / 'full'}", f"SHARDED_STATE_DICT={tmp / 'sharded'}"]
    return (tmp, *_launch_pair(tmp, regional=True, extra=save))


@pytest.mark.ci  # ~70 s of launches; make test compiles in process (regional, whole model, bf16 + checkpointing)
def test_accelerate_launch_compiled_matches_ddp(compiled_launch):
    """accelerate_configs/cpu_2proc_compile.yaml (the README yaml + dynamo INDUCTOR, regional) under
    ``accelerate launch``: DDP + the same compilation's losses, grad norms and eval loss within 1e-5;
    save_state (FULL and SHARDED) of the compiled model works."""
    tmp, ref, ours, proc = compiled_launch
    _assert_like_ddp(ref, ours, proc, 2)
    assert (tmp / "full" / "pytorch_model_fsdp.bin").exists() and (tmp / "sharded" / "pytorch_model_fsdp_0").is_dir()


@pytest.mark.slow
def test_accelerate_launch_compiled_resumes_exactly(compiled_launch):
    """A new compiled launch loads the step-4 FULL and SHARDED checkpoints and reproduces steps 5-8."""
    from launch_helpers import PLAIN_SCRIPT, launch, read_json

    tmp, _, ours, _ = compiled_launch
    out = tmp / "resume.json"
    launch(_compile_yaml(tmp, "resume.yaml", regional=True), PLAIN_SCRIPT,
           ["--model", "llama", "--no_cache", "--output_json", str(out), "--save_at", "4",
            "--resume_from", str(tmp / "full"), str(tmp / "sharded")], via_run=True, timeout=900)
    resumed = read_json(out)["resumed"]
    assert len(resumed) == 2
    for run in resumed:
        assert max(abs(a - b) for a, b in zip(run["losses"], ours["losses"][4:])) < 1e-6, run


@pytest.mark.slow
@pytest.mark.parametrize("processes,regional", [(4, True), (2, False), (4, False)],
                         ids=["W4-regional", "W2-whole", "W4-whole"])
def test_accelerate_launch_compiled_matches_ddp_matrix(tmp_path, processes, regional):
    """Both placements at W=2 and W=4 (oversubscribes a 2-core host) under accelerate launch (W=2 regional:
    the default test_accelerate_launch_compiled_matches_ddp)."""
    ref, ours, proc = _launch_pair(tmp_path, regional, processes)
    _assert_like_ddp(ref, ours, proc, processes)


@pytest.mark.slow
def test_trainer_torch_compile_trains_sharded_like_ddp(tmp_path):
    """The README's Trainer path with ``TrainingArguments(torch_compile=True)`` (accelerate's whole-model
    compile; inductor) through ``-m accel_flatshard.run`` and the README yaml: sharded, DDP + torch_compile's
    losses within 1e-5, no unit eager."""
    from launch_helpers import CPU_FSDP_YAML, SCRIPTS, ddp_config, launch, read_json

    results = {}
    for name, config, ddp in (("ddp", ddp_config(tmp_path), True), ("ours", CPU_FSDP_YAML, False)):
        out = tmp_path / name
        proc = launch(config, SCRIPTS / "trainer_causal_lm.py",
                      ["--output_dir", str(out / "run"), "--output_json", str(out / "result.json"), "--steps",
                       str(STEPS), "--torch_compile"], via_run=not ddp, ddp=ddp, timeout=900)
        results[name] = read_json(out / "result.json")
    ours, ref = results["ours"], results["ddp"]
    assert ours["distributed_type"] == "DistributedType.FSDP" and ours["world_size"] == 2
    assert sum(ours["local_trainable_numel"]) == ours["total_trainable_numel"]  # 1-D shards
    assert len(ours["losses"]) == STEPS and ours["dynamo_graphs"] > 0 and ref["dynamo_graphs"] > 0
    assert max(abs(ours["losses"][k] - ref["losses"][k]) for k in ref["losses"]) < TOL
    assert "runs eagerly" not in proc.stderr
