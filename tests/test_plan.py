"""The memory planner (``accel_flatshard.plan``, issue 25): its per-rank peak against the measured step peak.

Reference: the real step of the wrapped model, measured by torch's dispatch-level ``MemTracker``
(tests/plan_rows.py), on 1 rank in process, on 2 and 4 gloo ranks (one spawn each, many rows), and on the
CUDA simulator (its device peak: the host runs ahead of an infinitely slow GPU, the planner's CUDA
model).  The matrix: a Llama (untied head), a GPT-2 (tied head), a user's module (tests/toy.py: weight
tied across units, a unit called twice, a parameter-less unit, frozen parameters); FULL_SHARD,
SHARD_GRAD_OP, HYBRID_SHARD and its ZeRO-2 form; prefetch on, off and BACKWARD_POST; activation
checkpointing; bf16 (reduce in fp32 or bf16); offload; gradient accumulation both ways; a Mixtral in fp32 and
bf16 (experts through aten._grouped_mm); grouped K/V heads with an attention mask (issue 30); Muon over the hidden
matrices with AdamW over the rest (issue 44: the owners' whole momentum, the exchange's buffers).  The issue asks
for 10% on every row; the planner replays the engine's own rules, so the rows are held to 2%.  Also the command
line: every accelerate launch flag planned, inert or refused by name (issue 30), and `plan` against real
launches (the README's, gradient accumulation both ways, a 2 x 2 parallelism_config).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import warnings

import pytest
import torch

import dist_helpers
from launch_helpers import CPU_FSDP_YAML, REPO, SCRIPTS, launch, read_json
from plan_rows import BATCH, BF16, BF16_REDUCE_BF16, measure, measure_rows, row, snapshot_bytes, wrap

from accel_flatshard import plan
from accel_flatshard.core.options import BackwardPrefetch
from accel_flatshard.tools.plan_cli import main as plan_main

TOLERANCE = 0.02


def _check(rows, measured, what):
    table = []
    for r, real in zip(rows, measured):
        predicted = r.planner("cuda" if what == "simulated CUDA" else "cpu").predict(r.cfg)
        table.append((r, real, predicted, (predicted.peak_bytes - real) / real))
    print(f"\n{what}: planner vs measured step peak")
    for r, real, p, err in table:
        print(f"  W={r.world_size} {r.model:11} {r.label:30} measured {real / 2**20:7.3f} MiB  planner "
              f"{p.peak_bytes / 2**20:7.3f} MiB  {err:+.2%}  ({p.where})")
    worst = max(table, key=lambda t: abs(t[3]))
    assert abs(worst[3]) <= TOLERANCE, f"{worst[0]}: measured {worst[1]}, planner {worst[2]}"


ONE_RANK = [row("llama", 1, "FULL_SHARD"), row("gpt2", 1, "AC + bf16", BF16, activation_checkpointing=True),
            row("llama", 1, "bf16 (fp32 reduce)", BF16),
            row("toy", 1, "FULL_SHARD"), row("llama", 1, "micro-batch 2, no_sync", micro_batch=2, accumulation="no_sync")]
TWO_RANKS = [row("llama", 2, "SHARD_GRAD_OP", reshard_after_forward=False),
             row("gpt2", 2, "prefetch off", forward_prefetch=False, backward_prefetch=None),
             row("toy", 2, "offload", offload_params=True), row("llama", 2, "AC + bf16 (bf16 reduce)", BF16_REDUCE_BF16,
                                                           activation_checkpointing=True),
             row("gpt2", 2, "offload + bf16", BF16, offload_params=True),
             row("gpt2", 2, "micro-batch 2, sync_each_batch", micro_batch=2, accumulation="sync_each_batch"),
             row("llama-vocab", 2, "FULL_SHARD, large vocabulary"),
             row("llama", 2, "int8 weights and gradients", quantized_all_gather=True, quantized_reduce=True),
             row("llama", 2, "Muon + AdamW (owner computes)", optimizer="muon")] + (
    [row("qlora", 2, "QLoRA: 4-bit base, LoRA")] if importlib.util.find_spec("bitsandbytes") else [])
FOUR_RANKS = [row("llama", 4, "HYBRID_SHARD group 2", fsdp_group_size=2),
              row("gpt2", 4, "_HYBRID_SHARD_ZERO2 group 2 + AC", fsdp_group_size=2, reshard_after_forward=False,
                  activation_checkpointing=True),
              row("toy", 4, "bf16, BACKWARD_POST", BF16, forward_prefetch=False,
                  backward_prefetch=BackwardPrefetch.BACKWARD_POST),
              row("llama", 4, "FULL_SHARD + node-local backward gather, 2 ranks per node", ranks_per_node=2,
                  node_local_backward_gather=True)]


@pytest.mark.usefixtures("world_of_one")
def test_planner_peak_matches_the_measured_step_one_rank():
    _check(ONE_RANK, [measure(r) for r in ONE_RANK], "1 rank")


@pytest.mark.usefixtures("world_of_one")
def test_planner_counts_4bit_weights_as_their_storage_and_matches_a_qlora_step():
    """A QLoRA model (issue 44): its 4-bit weights are sharded and planned as their bf16 storage (4 weights per
    element), and the plan matches the measured step (the issue asks for 10%)."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is an optional extra: pip install 'accel_flatshard[bnb]'")
    from plan_rows import qlora

    model = qlora()
    weight = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert weight.dtype == torch.bfloat16 and weight.numel() == 64 * 64 // 4
    r = row("qlora", 1, "QLoRA: 4-bit base, LoRA")
    assert r.planner().numel == sum(p.numel() for p in model.parameters())  # (storage elements)
    _check([r], [measure(r)], "1 rank, 4-bit base")
    # the command line too (its model factory moves the model to the meta device: 4-bit weights are copied there)
    assert plan_main(["--model", "tests/plan_rows.py:qlora", "--seq_len", "32", "--use_fsdp", "--num_processes", "2",
                      "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--device", "cpu", "--json"]) == 0


@pytest.mark.usefixtures("world_of_one")
def test_planner_plans_an_fp32_mixture_of_experts_through_grouped_mm():
    """transformers runs Mixtral's experts through aten._grouped_mm, whose fake kernel accepts only bf16 (issue 30:
    the planner refused the model, blaming Python branching); the CPU kernel runs fp32 and the planner matches it."""
    rows = [row("mixtral", 1, "MoE fp32 (grouped_mm)"), row("mixtral", 1, "MoE bf16 (grouped_mm)", BF16)]
    _check(rows, [measure(r) for r in rows], "1 rank, mixture of experts")


def test_planner_refuses_a_data_dependent_expert_path_naming_the_op():
    """Mixtral's eager experts loop over the experts hit (nonzero): the memory depends on the data."""
    r = row("mixtral-eager", 1)
    with pytest.raises(ValueError, match=r"aten\.nonzero\.default's output shape depends on the tensor values"):
        r.planner().predict(r.cfg)


@pytest.mark.usefixtures("world_of_one")
def test_planner_follows_the_real_runs_attention_mask_path_with_grouped_kv_heads():
    """An all-ones attention mask: the real run skips the 4-D causal mask and SDPA reads the 2 K/V heads as they
    are; a fake mask made transformers take its tracing path (mask built, K/V repeated: issue 30, +16% here)."""
    rows = [row("llama-gqa", 1, "GQA, 256 tokens, all-ones attention mask")]
    _check(rows, [measure(r) for r in rows], "1 rank, grouped-query attention")


@pytest.fixture(scope="module")
def too_large():
    """A Llama whose default configuration needs more than the device has: the planner's fastest fitting one."""
    default = row("llama", 2, "FULL_SHARD, 80% of its peak")
    planner = default.planner()
    device_memory = int(0.8 * planner.predict(default.cfg).peak_bytes)
    fitting = plan.recommend(planner, device_memory, limit=1)[0][0]
    return default, row("llama", 2, "the recommended", **vars(fitting)), device_memory


@pytest.fixture(scope="module")
def two_ranks(too_large):
    default, recommended, limit = too_large
    rows = TWO_RANKS + [default, recommended]
    results = dist_helpers.spawn(2, measure_rows, rows, [None] * len(TWO_RANKS) + [limit, limit], timeout_s=300)
    return [[rank[i] for rank in results] for i in range(len(rows))]


def test_planner_peak_matches_the_measured_step_two_ranks(two_ranks):
    _check(TWO_RANKS, [max(per_rank) for per_rank in two_ranks[:len(TWO_RANKS)]], "2 gloo ranks")


def test_a_model_too_large_gets_a_configuration_that_stays_under_the_memory(too_large, two_ranks):
    """With the device memory enforced by the tracker: the default configuration runs out of it, the
    recommended one (expected fastest of those predicted to fit) trains within it on every rank."""
    default, recommended, limit = too_large
    assert recommended.cfg != default.cfg
    assert all(isinstance(r, str) and "bytes in use" in r for r in two_ranks[-2]), two_ranks[-2]
    assert all(isinstance(r, int) and r <= limit for r in two_ranks[-1]), (two_ranks[-1], limit, recommended)


def test_planner_peak_matches_the_measured_step_four_ranks():
    results = dist_helpers.spawn(4, measure_rows, FOUR_RANKS, [None] * len(FOUR_RANKS), timeout_s=300)
    _check(FOUR_RANKS, [max(rank[i] for rank in results) for i in range(len(FOUR_RANKS))], "4 gloo ranks")


SIMULATED = [row("llama", 1, "FULL_SHARD"), row("gpt2", 1, "SHARD_GRAD_OP", reshard_after_forward=False),
             row("llama", 1, "offload + bf16", BF16, offload_params=True), row("gpt2", 1, "limit_all_gathers 1, bf16", BF16,
                                                                        limit_all_gathers=1)]


@pytest.mark.usefixtures("world_of_one")
def test_planner_cuda_model_matches_the_simulators_device_peak():
    from sim_cuda import simulate_cuda

    measured = []
    for r in SIMULATED:
        wrapped = wrap(r)
        sim = simulate_cuda(wrapped)
        measured.append(measure(r, sim=sim, wrapped=wrapped))
        assert sim.violations == []
    _check(SIMULATED, measured, "simulated CUDA")


@pytest.mark.usefixtures("world_of_one")
def test_the_plan_follows_a_flipped_schedule_rule(monkeypatch):
    """The planner runs the wrapper's own Schedule and Engine (issue 33): with one rule of the schedule flipped
    (backward prefetch gathers nothing), the plan moves with it, to the real step's peak under the same flip;
    a planner with rules of its own would still predict the unflipped peak, and fail here."""
    from accel_flatshard.core import fully_sharded

    r = row("llama", 1, "FULL_SHARD, prefetch BACKWARD_PRE", forward_prefetch=False)
    before = r.planner().predict(r.cfg).peak_bytes
    monkeypatch.setattr(fully_sharded.Schedule, "_prefetch_before", lambda self, unit: None)
    flipped, measured = r.planner().predict(r.cfg).peak_bytes, measure(r)
    assert abs(flipped - measured) <= TOLERANCE * measured and abs(before - measured) > TOLERANCE * measured, \
        (before, flipped, measured)


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_plan_counts_the_async_save_snapshot_in_host_memory(state_dict_type, monkeypatch):
    """FLATSHARD_ASYNC_SAVE=1 (issue 31): the plan's host line is the bytes the snapshot really holds on rank 0 of
    2 gloo ranks: SHARDED, its shard of the parameters and AdamW state (about 12 bytes x parameters / W); FULL,
    the whole model and optimizer state gathered to rank 0."""
    r = row("llama", 2, "FULL_SHARD")
    real = dist_helpers.spawn(2, snapshot_bytes, r, timeout_s=300)[0][state_dict_type]
    monkeypatch.setenv("FLATSHARD_ASYNC_SAVE", "1")
    planner = r.planner()
    planner.options = dataclasses.replace(planner.options, state_dict_type=state_dict_type)
    planned = planner.predict(r.cfg).snapshot
    numel = planner.numel
    print(f"\n{state_dict_type}: snapshot planned {planned:,} bytes, real {real:,} (12 x {numel:,} parameters "
          f"= {12 * numel:,})")
    assert planned == real and 0.9 * 12 * numel / (2 if "SHARDED" in state_dict_type else 1) < real


# ---------------------------------------------------------------------- the README path, under accelerate launch
@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """`make example`'s GPT-2 (4 x 128, byte vocabulary) and cpu_2proc.yaml, batch 8 x 128 per device: the
    planner's JSON, then 3 steps under accelerate launch measured on each rank, with prepare's check given
    a device of 40 MiB (its free memory reported by a stand-in for CUDA's)."""
    work = tmp_path_factory.mktemp("plan_readme")
    sys.path.insert(0, str(REPO / "examples"))
    import train_causal_lm

    train_causal_lm.build_model("gpt2-tiny", 257, 128).config.save_pretrained(work / "model")
    cmd = [sys.executable, "-m", "accel_flatshard.tools.plan_cli", "--model", str(work / "model"), "--config_file",
           str(CPU_FSDP_YAML), "--batch_size", "8", "--seq_len", "128", "--device_memory", "40MiB", "--json"]
    planned = json.loads(subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True, timeout=300).stdout)
    out = work / "measured.json"
    launch(CPU_FSDP_YAML, SCRIPTS / "plan_measure.py", ["--model", str(work / "model"), "--out", str(out),
                                                        "--device_memory", str(40 * 2**20)])
    return planned, read_json(out)


@pytest.mark.ci  # the CLI with --device_memory (26 fake runs) + a launch: ~2 min
def test_readme_example_under_accelerate_launch_matches_the_planner(readme_run):
    planned, measured = readme_run
    worst = max(measured["peak_bytes"])
    assert abs(planned["peak_bytes"] - worst) <= TOLERANCE * worst, (planned["peak_bytes"], measured["peak_bytes"])
    assert planned["fits"] and planned["recommended"][0].startswith("fsdp_sharding_strategy")


@pytest.mark.ci  # the CLI with --device_memory (26 fake runs) + a launch: ~2 min
def test_prepare_warns_once_before_the_first_step_when_the_prediction_exceeds_free_memory(readme_run):
    planned, measured = readme_run
    first, later = measured["warnings_first_forward"], measured["warnings_later"]
    assert len(first) == 1 and "exceeds the 0.04 GiB available" in first[0], first
    assert f"{planned['peak_bytes'] / 2**30:.2f} GiB per rank" in first[0]
    assert "fsdp_activation_checkpointing: true" in first[0] and not later


# ---------------------------------------------------------------------- the command line
def test_cli_plans_a_users_own_module_with_its_batch_function(capsys):
    status = plan_main(["--model", "tests/plan_rows.py:toy", "--make_batch", "tests/plan_rows.py:toy_cli_batch",
                        "--batch_size", str(BATCH), "--use_fsdp", "--num_processes", "2", "--fsdp_auto_wrap_policy",
                        "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block,Scale", "--json",
                        "--device", "cpu"])
    out = json.loads(capsys.readouterr().out)
    assert status == 0 and out["model"].startswith("Toy") and "blocks.2" in out["model"] + out["where"]
    # the launch flags' defaults: no prefetch (accelerate's None is NO_PREFETCH)
    reference = row("toy", 2, "FULL_SHARD", forward_prefetch=False, backward_prefetch=None)
    assert out["peak_bytes"] == reference.planner().predict(reference.cfg).peak_bytes


@pytest.mark.parametrize("argv, message", [
    (["--model", "no/such/dir", "--config_file", str(CPU_FSDP_YAML)], "no Hugging Face config"),
    (["--model", "tests/toy.py:Toy", "--config_file", str(CPU_FSDP_YAML)], "--make_batch"),
    (["--model", "tests/toy.py:Toy", "--num_processes", "2", "--make_batch", "tests/plan_rows.py:toy_cli_batch"],
     "not an FSDP launch"),
    (["--model", "tests/toy.py:Toy", "--use_fsdp", "--make_batch", "tests/plan_rows.py:toy_cli_batch",
      "--device_memory", "lots"], "expected a size"),
])
def test_cli_errors_name_the_flag_at_fault(argv, message, capsys):
    assert plan_main(argv) == 1
    assert message in capsys.readouterr().err


def test_device_memory_sizes_parse_binary_and_decimal():
    from accel_flatshard.core.sizes import parse_size  # (also consolidate's --max-shard-size)

    assert parse_size("80GiB") == parse_size("80G") == 80 * 2**30 and parse_size("24GB") == 24 * 10**9
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1e9") == 10**9


# ---------------------------------------------------------------------- launch settings (issue 30)
TOY_LAUNCH = ["--model", "tests/plan_rows.py:toy", "--make_batch", "tests/plan_rows.py:toy_cli_batch", "--batch_size",
              "2", "--device", "cpu", "--use_fsdp", "--num_processes", "2", "--fsdp_auto_wrap_policy",
              "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block,Scale"]


def _launch_actions():
    from accelerate.commands.launch import launch_command_parser

    return {a.dest: a for a in launch_command_parser()._actions if a.option_strings and a.dest != "help"}


def _non_default(action) -> list:
    """The flag of ``action`` asking for something other than its default."""
    flag = next(o for o in action.option_strings if o.startswith("--") and "_" in o or o == "--" + action.dest)
    if action.nargs == 0:
        return [flag]
    if action.dest == "fsdp_state_dict_type":
        return [flag, "SHARDED_STATE_DICT"]
    if action.choices:
        other = [str(c) for c in action.choices if str(c).lower() not in ("no", str(action.default).lower())]
        return [flag, (other or [str(c) for c in action.choices])[0]]  # (a single choice: itself)
    if isinstance(action.default, tuple):
        return [flag, ",".join(["true"] * len(action.default))]
    if str(action.default).lower() in ("true", "false"):
        return [flag, "false" if str(action.default).lower() == "true" else "true"]
    if action.type in (int, float):
        return [flag, "3" if action.default in (None, 2) else "2"]
    return [flag, "x"]


def _inputs(argv):
    """What the plan is computed from (nothing traced)."""
    from accel_flatshard.tools.plan_cli import build_parser, planned

    planner, cfg = planned(*build_parser().parse_known_args(argv))
    # (the options the planner never reads: loading and the checkpoint format)
    options = dataclasses.replace(planner.options, state_dict_type="", sync_module_states=True)
    assert cfg.options is planner.options  # (the run's options are the launch's)
    return (options, planner.world_size, planner.batch_size, planner.autocast, planner.num_machines,
            planner.names, dataclasses.replace(cfg, options=options))


def test_every_launch_flag_is_planned_inert_or_refused():
    from accel_flatshard.tools.plan_launch import INERT, PLANNED, REFUSED

    assert not (set(PLANNED) & set(INERT) or set(PLANNED) & set(REFUSED) or set(INERT) & set(REFUSED))
    unclassified = [d for d in _launch_actions() if d not in {**PLANNED, **INERT, **REFUSED}
                    and not d.startswith("megatron_lm_")]
    assert not unclassified, f"accelerate launch flags the planner does not know: {unclassified}"


def _refused():
    from accel_flatshard.tools.plan_launch import INERT, PLANNED

    return sorted(d for d in _launch_actions() if d not in PLANNED and d not in INERT)


@pytest.mark.parametrize("dest", _refused())
def test_a_refused_launch_flag_stops_the_plan_naming_it(dest, capsys):
    argv = TOY_LAUNCH + _non_default(_launch_actions()[dest])
    assert plan_main(argv) == 1, argv
    name = dest.removeprefix("use_").removeprefix("fsdp_").removeprefix("parallelism_config_")
    assert name in capsys.readouterr().err.replace("-", "_")  # (accelerate's own checks name some first)


def _inert():
    from accel_flatshard.tools.plan_launch import INERT

    return sorted(d for d in _launch_actions() if d in INERT)


def test_inert_launch_flags_leave_the_plan_unchanged():
    baseline = _inputs(TOY_LAUNCH)
    changed = {d: _non_default(_launch_actions()[d]) for d in _inert()}
    assert {d: argv for d, argv in changed.items() if _inputs(TOY_LAUNCH + argv) != baseline} == {}


PLANNED_FLAGS = {  # each planned flag (or yaml key), set to something else than the baseline's value
    "config_file": ["--config_file", str(CPU_FSDP_YAML)], "num_processes": ["--num_processes", "4"],
    "num_machines": ["--num_processes", "4", "--num_machines", "2"], "mixed_precision": ["--mixed_precision", "bf16"],
    "fsdp_version": ["--fsdp_version", "2"], "fsdp_sharding_strategy": ["--fsdp_sharding_strategy", "SHARD_GRAD_OP"],
    "fsdp_reshard_after_forward": ["--fsdp_version", "2", "--fsdp_reshard_after_forward", "false"],
    "fsdp_offload_params": ["--fsdp_offload_params", "true"], "fsdp_backward_prefetch": ["--fsdp_backward_prefetch",
                                                                                         "BACKWARD_POST"],
    "fsdp_auto_wrap_policy": ["--fsdp_auto_wrap_policy", "NO_WRAP"],
    "fsdp_transformer_layer_cls_to_wrap": ["--fsdp_transformer_layer_cls_to_wrap", "Block"],
    "fsdp_min_num_params": ["--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "--fsdp_min_num_params", "100"],
    "fsdp_forward_prefetch": ["--fsdp_forward_prefetch", "true"],
    "fsdp_activation_checkpointing": ["--fsdp_activation_checkpointing", "true"],
    "use_parallelism_config": ["--fsdp_version", "2", "--use_parallelism_config", "--parallelism_config_dp_shard_size",
                               "2"],
    "parallelism_config_dp_replicate_size": ["--fsdp_version", "2", "--num_processes", "4", "--use_parallelism_config",
                                             "--parallelism_config_dp_replicate_size", "2",
                                             "--parallelism_config_dp_shard_size", "2"],
    "parallelism_config_dp_shard_size": ["--fsdp_version", "2", "--use_parallelism_config",
                                         "--parallelism_config_dp_shard_size", "1",
                                         "--parallelism_config_dp_replicate_size", "2"],
    "gradient_accumulation_steps": ["--gradient_accumulation_steps", "2"]}


def test_every_planned_launch_flag_reaches_the_plan():
    from accel_flatshard.tools.plan_launch import PLANNED

    assert set(PLANNED_FLAGS) == set(PLANNED) - {"use_fsdp"}  # (the baseline's own flag)
    baseline = _inputs(TOY_LAUNCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (dp_shard_size 1 warns: DDP semantics)
        dropped = [d for d, argv in PLANNED_FLAGS.items() if _inputs(TOY_LAUNCH + argv) == baseline]
    assert not dropped, f"accepted, then dropped: {dropped}"


def test_parallelism_config_flags_and_yaml_block_plan_the_hybrid_layout():
    """A 2 x 2 HSDP layout is planned as HYBRID_SHARD in groups of 2 (the measured 4-rank row), not FULL_SHARD
    over 4; the --parallelism_config_* flags give the same plan as the yaml's block."""
    hsdp = REPO / "accelerate_configs" / "cpu_4proc_fsdp2_hsdp.yaml"
    from_yaml = _inputs(TOY_LAUNCH[:8] + ["--config_file", str(hsdp)])
    from_flags = _inputs(TOY_LAUNCH + ["--fsdp_version", "2", "--num_processes", "4", "--use_parallelism_config",
                                       "--parallelism_config_dp_replicate_size", "2",
                                       "--parallelism_config_dp_shard_size", "2"])
    assert from_yaml[-1].knobs() == from_flags[-1].knobs() and from_yaml[-1].strategy(4) == "HYBRID_SHARD"
    assert from_yaml[-1].shard_size(4) == 2 and from_flags[0].fsdp_group_size == 2


def test_gradient_accumulation_from_the_yaml_plans_as_the_flag(tmp_path):
    yaml = tmp_path / "accumulate.yaml"
    yaml.write_text(CPU_FSDP_YAML.read_text().replace("fsdp_config:\n", "deepspeed_config:\n  gradient_accumulation_steps"
                                                      ": 2\nfsdp_config:\n"))
    from_yaml = _inputs(TOY_LAUNCH[:8] + ["--config_file", str(yaml)])
    from_flag = _inputs(TOY_LAUNCH[:8] + ["--config_file", str(CPU_FSDP_YAML), "--gradient_accumulation_steps", "2"])
    assert from_yaml == from_flag and from_yaml[-1].accumulation == "no_sync" and from_yaml[2] == 2 * 2


@pytest.mark.parametrize("argv, message", [
    (["--accumulation", "sync_each_batch"], "needs --gradient_accumulation_steps > 1"),
    (["--gradient_accumulation_steps", "0"], "must be >= 1"),
    (["--config_file", str(REPO / "accelerate_configs" / "cpu_2proc_compile.yaml")], "dynamo_backend='INDUCTOR'"),
    (["--fsdp_version", "2", "--num_processes", "4", "--use_parallelism_config",
      "--parallelism_config_dp_replicate_size", "2"], "is 2 processes, but num_processes is 4"),
])
def test_cli_refuses_launch_settings_it_cannot_plan(argv, message, capsys):
    assert plan_main(TOY_LAUNCH + argv) == 1
    assert message in capsys.readouterr().err


def test_cli_refuses_an_unknown_yaml_key(tmp_path, capsys):
    yaml = tmp_path / "typo.yaml"
    yaml.write_text(CPU_FSDP_YAML.read_text().replace("fsdp_config:\n", "fsdp_config:\n  fsdp_shardng_strategy: NO_SHARD\n"))
    assert plan_main(TOY_LAUNCH[:8] + ["--config_file", str(yaml)]) == 1
    assert "'fsdp_shardng_strategy'" in capsys.readouterr().err


def _plan_and_launch(work, yaml, plan_flags, script_flags):
    """`accel-flatshard plan --json` and the measured run (plan_measure.py) of the same launch: (planned, per rank)."""
    cmd = [sys.executable, "-m", "accel_flatshard.tools.plan_cli", "--model", str(work / "model"), "--config_file", str(yaml),
           "--seq_len", "128", "--json", *plan_flags]
    planned = json.loads(subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True, timeout=300).stdout)
    out = work / f"measured-{len(list(work.iterdir()))}.json"
    launch(yaml, SCRIPTS / "plan_measure.py", ["--model", str(work / "model"), "--out", str(out), *script_flags])
    return planned, read_json(out)["peak_bytes"]


@pytest.fixture(scope="module")
def gpt2_config(tmp_path_factory):
    work = tmp_path_factory.mktemp("plan_launch")
    sys.path.insert(0, str(REPO / "examples"))
    import train_causal_lm

    train_causal_lm.build_model("gpt2-tiny", 257, 128).config.save_pretrained(work / "model")
    return work


def _within_tolerance(planned, measured):
    worst = max(measured)
    assert abs(planned["peak_bytes"] - worst) <= TOLERANCE * worst, (planned["peak_bytes"], measured)


@pytest.mark.ci  # (make test under 9 minutes: CI runs it)
def test_cli_gradient_accumulation_matches_accelerator_accumulate(gpt2_config):
    """--gradient_accumulation_steps 2 (default: what accelerator.accumulate does, no_sync: the full gradients
    kept until the last micro-step) against 2 micro-batches of 4 under accelerate launch (issue 30: -17.8%)."""
    planned, measured = _plan_and_launch(gpt2_config, CPU_FSDP_YAML, ["--batch_size", "4", "--gradient_accumulation_steps",
                                         "2"], ["--batch_size", "4", "--gradient_accumulation_steps", "2"])
    assert "(no_sync) x 2 accumulation steps" in planned["config"]
    _within_tolerance(planned, measured)


@pytest.mark.ci
def test_cli_accumulation_sync_each_batch_matches_the_plugins_run(gpt2_config):
    planned, measured = _plan_and_launch(
        gpt2_config, CPU_FSDP_YAML, ["--batch_size", "4", "--gradient_accumulation_steps", "2", "--accumulation",
                                     "sync_each_batch"], ["--batch_size", "4", "--gradient_accumulation_steps", "2",
                                                          "--sync_each_batch"])
    _within_tolerance(planned, measured)


@pytest.mark.ci
def test_cli_parallelism_config_matches_the_4_process_hsdp_launch(gpt2_config):
    """The yaml's parallelism_config block (2 replicas x shard groups of 2) against its launch (issue 30: -14.8%)."""
    hsdp = REPO / "accelerate_configs" / "cpu_4proc_fsdp2_hsdp.yaml"
    planned, measured = _plan_and_launch(gpt2_config, hsdp, ["--batch_size", "4"], ["--batch_size", "4"])
    assert planned["config"].startswith("HYBRID_SHARD group 2")
    _within_tolerance(planned, measured)


def test_planner_counts_units_kept_gathered_across_micro_batches_and_their_once_per_step_gathers():
    """keep_gathered_across_micro_batches: the predicted peak holds every unit gathered (higher than without; the
    measured rows above hold it to the real step), and the cost model gathers once per step instead of per
    micro-step (fewer seconds)."""
    base = row("llama", 2, "no_sync", micro_batch=2, accumulation="no_sync")
    keep = row("llama", 2, "no_sync, keep gathered", micro_batch=2, accumulation="no_sync",
               keep_gathered_across_micro_batches=True)
    planner = base.planner("cpu")
    assert planner.predict(keep.cfg).peak_bytes > planner.predict(base.cfg).peak_bytes
    assert plan.step_time(planner, keep.cfg) < plan.step_time(planner, base.cfg)
    hybrid = row("llama", 4, "hybrid no_sync", micro_batch=2, accumulation="no_sync", fsdp_group_size=2)
    deferred = row("llama", 4, "hybrid no_sync, deferred", micro_batch=2, accumulation="no_sync", fsdp_group_size=2,
                   defer_cross_machine_reduce=True)
    planner4 = hybrid.planner("cpu")
    # (deferring reduces inside the group every micro-step: more time than one reduction, for a shard's memory)
    assert plan.step_time(planner4, deferred.cfg) > plan.step_time(planner4, hybrid.cfg)
    assert planner4.predict(deferred.cfg).peak_bytes < planner4.predict(hybrid.cfg).peak_bytes


ACCUMULATION_OVER_SLOW_LINKS = [
    row("llama", 2, "micro-batch 1, no_sync, keep gathered", micro_batch=1, accumulation="no_sync",
        keep_gathered_across_micro_batches=True),
    row("llama", 4, "HYBRID group 2, micro-batch 1, no_sync, keep gathered + deferred", micro_batch=1,
        accumulation="no_sync", fsdp_group_size=2, keep_gathered_across_micro_batches=True,
        defer_cross_machine_reduce=True)]


@pytest.mark.parametrize("r", [pytest.param(ACCUMULATION_OVER_SLOW_LINKS[0], id="keep-w2"),
                               pytest.param(ACCUMULATION_OVER_SLOW_LINKS[1], id="keep-defer-w4", marks=pytest.mark.ci)])
def test_planner_peak_matches_the_measured_step_accumulating_over_slow_links(r):
    results = dist_helpers.spawn(r.world_size, measure_rows, [r], [None], timeout_s=300)
    _check([r], [max(rank[0] for rank in results)], f"{r.world_size} gloo ranks")
