"""Generation under sharding (generation.py) against accelerate DDP on 2 gloo processes, plus the options.

``gen_parity.py`` generates greedily in every mode (``unwrap_model(model).generate``: full / budget / auto /
per-unit; inside ``summon_full_params`` with and without writeback; after ``to(torch.bfloat16)`` inside the
summon), then trains two steps; every token and loss must equal DDP's.
"""
import pytest
import torch

from launch_helpers import CPU_FSDP_YAML, SCRIPTS, ddp_config, ddp_reference, fsdp_config, launch, max_abs_diff, read_json

MODES = ("full", "budget", "auto", "per_unit", "summon_wb0", "summon_wb1", "summon_bf16", "after_training")


gen_parity_ddp = ddp_reference("gen_parity_ddp", SCRIPTS / "gen_parity.py", lambda out: ["--output_json", out / "ddp.json"])


@pytest.fixture(scope="module")
def parity(tmp_path_factory, gen_parity_ddp):
    tmp = tmp_path_factory.mktemp("gen")
    script = SCRIPTS / "gen_parity.py"
    # the README yaml without forward prefetch: per-unit generation then holds one unit at a time, so the
    # units the budget mode keeps show in its measured peak (test_budget_mode_stays_within_its_budget)
    yaml = fsdp_config(tmp, "no_forward_prefetch.yaml", fsdp_forward_prefetch=False)
    launch(yaml, script, ["--output_json", str(tmp / "fs.json")], via_run=True)
    return read_json(gen_parity_ddp / "ddp.json"), read_json(tmp / "fs.json")


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_equal_ddps(parity, mode):
    ddp, ours = parity
    assert ours["tokens"][mode] == ddp["tokens"][mode]
    assert len(ours["tokens"][mode]) == 4  # 2 ranks x batch 2, gathered


def test_training_after_generation_equals_ddps(parity):
    ddp, ours = parity
    assert max_abs_diff(ours["losses"], ddp["losses"]) == 0.0


def test_gather_once_gathers_each_flat_parameter_once_per_generate(parity):
    _, ours = parity
    flats = ours["num_flats"]
    assert ours["gathers"]["full"] == flats and ours["gathers"]["auto"] == flats
    assert ours["gathers"]["per_unit"] >= 12 * flats  # 12 decoding steps, every unit each time
    assert ours["gathers"]["summon_wb0"] == 0 and ours["gathers"]["summon_wb1"] == 0  # generate inside a summon
    assert flats < ours["gathers"]["budget"] < ours["gathers"]["per_unit"]


def test_budget_mode_stays_within_its_budget(parity):
    _, ours = parity
    kept, kept_bytes, budget = ours["plan"]["budget"]
    assert budget == ours["budget"] == ours["total_bytes"] // 2
    assert 0 < kept < 7 and 0 < kept_bytes <= budget
    assert ours["peak_held"]["budget"] <= budget  # measured: gathered bytes held at any moment
    assert ours["peak_held"]["full"] == ours["total_bytes"]
    assert ours["peak_held"]["per_unit"] < ours["peak_held"]["budget"]


def test_bf16_cast_inside_summon_leaves_fp32_masters_bitwise(parity):
    _, ours = parity
    assert ours["masters_fp32"] and ours["params_fp32"] and ours["buffers_kept"] and ours["masters_bitwise"]


# ---------------------------------------------------------------------- single process: options and plan
def test_options_from_env(monkeypatch):
    from accel_flatshard.core.options import FlatShardOptions

    monkeypatch.delenv("FLATSHARD_GENERATION_MODE", raising=False)
    monkeypatch.delenv("FLATSHARD_GENERATION_BUDGET_MB", raising=False)
    options = FlatShardOptions.from_environment()
    assert options.generation_mode == "budget" and options.generation_budget_mb is None
    assert not options.keep_frozen_gathered
    monkeypatch.setenv("FLATSHARD_GENERATION_MODE", "per-unit")
    monkeypatch.setenv("FLATSHARD_GENERATION_BUDGET_MB", "1.5")
    monkeypatch.setenv("FLATSHARD_KEEP_FROZEN_GATHERED", "1")
    options = FlatShardOptions.from_environment()
    assert options.generation_mode == "per_unit" and options.generation_budget_mb == 1.5
    assert options.keep_frozen_gathered
    monkeypatch.setenv("FLATSHARD_GENERATION_MODE", "fast")
    with pytest.raises(ValueError, match="FLATSHARD_GENERATION_MODE"):
        FlatShardOptions.from_environment()


def _tiny_wrapped(**kwargs):
    import transformers
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    reference.load_state_dict(model.state_dict())
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **kwargs), reference


def test_plan_respects_budget_and_prefetch(world_of_one):
    from accel_flatshard.features.generation import peak_held_bytes, plan_kept_units, unit_bytes

    wrapped, _ = _tiny_wrapped()
    units = wrapped.units
    total = sum(unit_bytes(u) for u in units)
    assert plan_kept_units(units, total, False) == units
    minimum = peak_held_bytes(units, [], True)
    assert plan_kept_units(units, minimum - 1, True) == []
    for budget in (minimum, max(minimum, total // 2), total - 1):
        kept = plan_kept_units(units, budget, True)
        assert peak_held_bytes(units, kept, True) <= budget


def test_summon_accepts_torch_signature_and_refuses_unsupported(world_of_one):
    wrapped, reference = _tiny_wrapped()
    ids = torch.randint(0, 64, (1, 5))
    with wrapped.summon_full_params(writeback=False, recurse=False):
        out = wrapped.module(ids).logits  # a forward inside the summon runs the plain model
    assert torch.equal(out, reference(ids).logits)
    with pytest.raises(TypeError, match="rank0_only"):  # (torch FSDP's arguments this summon cannot honour)
        with wrapped.summon_full_params(rank0_only=True):
            pass


def test_frozen_model_keeps_units_until_the_optimizer_step(world_of_one):
    from accel_flatshard.features.generation import set_generation_options

    frozen_ref, ref_plain = _frozen_wrapped()
    set_generation_options(frozen_ref, keep_frozen_gathered=True)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        first = frozen_ref(ids).logits
        assert all(f.unsharded.untyped_storage().nbytes() for f in frozen_ref.flat_params)  # kept across micro-batches
        second = frozen_ref(ids).logits
    assert torch.equal(first, ref_plain(ids).logits) and torch.equal(second, first)
    from accel_flatshard.features.generation import control_of

    frozen_ref(ids)  # a forward with grad releases them first (training frees units after use)
    assert not control_of(frozen_ref).kept
    with torch.no_grad():
        frozen_ref(ids)
    assert control_of(frozen_ref).kept and all(f.unsharded.untyped_storage().nbytes() for f in frozen_ref.flat_params)
    trainable = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([trainable], lr=0.1)
    trainable.grad = torch.ones(1)
    opt.step()  # any optimizer step releases them (TRL's sync_ref_model writes after it)
    assert not any(f.unsharded.untyped_storage().nbytes() for f in frozen_ref.flat_params)
    set_generation_options(frozen_ref, keep_frozen_gathered=False)
    with torch.no_grad():
        frozen_ref(ids)
    assert not any(f.unsharded.untyped_storage().nbytes() for f in frozen_ref.flat_params)


def _frozen_wrapped():
    import transformers
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    torch.manual_seed(1)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    plain = transformers.AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict())
    model.requires_grad_(False)
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model)), plain


# ---------------------------------------------------------------------- TRL online RL through the seam
def _trl_both(tmp, *args):
    script = SCRIPTS / "trl_grpo.py"
    launch(ddp_config(tmp), script, [*args, "--output_dir", str(tmp / "ddp"), "--output_json", str(tmp / "ddp.json")],
           ddp=True)
    launch(CPU_FSDP_YAML, script, [*args, "--output_dir", str(tmp / "fs"), "--output_json", str(tmp / "fs.json")],
           via_run=True)
    return read_json(tmp / "ddp.json"), read_json(tmp / "fs.json")


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_trl_online_rl_through_the_summon_seam_follows_ddp(tmp_path, trainer):
    """TRL's ``DistributedBackend.summon_full_params(model_wrapped, recurse=False)`` reaches our summon."""
    ddp, ours = _trl_both(tmp_path, "--trainer", trainer)
    assert ours["seam_patched"] and not ddp["seam_patched"]
    assert len(ours["losses"]) == 3
    assert max_abs_diff(ours["losses"], ddp["losses"]) < 1e-5
    assert max_abs_diff(ours["rewards"], ddp["rewards"]) < 1e-5  # same generations
    assert ours["ref_class"] == "FullyShardedDataParallel"


@pytest.mark.slow
def test_grpo_with_bf16_runs_and_keeps_fp32_masters(tmp_path):
    launch(CPU_FSDP_YAML, SCRIPTS / "trl_grpo.py",
           ["--bf16", "--output_dir", str(tmp_path / "fs"), "--output_json", str(tmp_path / "fs.json")], via_run=True)
    ours = read_json(tmp_path / "fs.json")
    assert ours["seam_patched"] and len(ours["losses"]) == 3
    assert all(abs(x) < 1e3 for x in ours["losses"]) and all(r is not None for r in ours["rewards"])
    assert ours["param_dtypes"] == ["torch.float32"]  # the master shards stay fp32
    assert ours["ref_class"] == "FullyShardedDataParallel"  # sharded (not an unsharded CPU fallback)


def test_slower_modes_say_so_once_with_the_option_to_set(world_of_one):
    from accel_flatshard.features.generation import set_generation_options, unit_bytes

    wrapped, reference = _tiny_wrapped()
    ids = torch.randint(3, 64, (1, 4))
    kw = dict(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = reference.generate(ids, **kw)
    set_generation_options(wrapped, generation_mode="per_unit")
    with pytest.warns(UserWarning, match="FLATSHARD_GENERATION_MODE=budget"):
        assert torch.equal(wrapped.module.generate(ids, **kw), expected)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        wrapped.module.generate(ids, **kw)
    total = sum(unit_bytes(u) for u in wrapped.units)
    set_generation_options(wrapped, generation_mode="budget", generation_budget_mb=(total - 1) / 2**20)
    with pytest.warns(UserWarning, match="FLATSHARD_GENERATION_BUDGET_MB"):
        assert torch.equal(wrapped.module.generate(ids, **kw), expected)


@pytest.mark.slow
def test_under_bf16_mixed_precision_generation_leaves_training_bitwise_unchanged(tmp_path):
    """bf16 compute (fp32 masters): every generation mode and the summon with ``to(torch.bfloat16)``, then two
    training steps; the losses equal bitwise those of the same launch that never generated."""
    yaml = fsdp_config(tmp_path, "bf16.yaml", mixed_precision="bf16")
    script = SCRIPTS / "gen_parity.py"
    launch(yaml, script, ["--output_json", str(tmp_path / "gen.json")], via_run=True)
    launch(yaml, script, ["--skip_generation", "--output_json", str(tmp_path / "plain.json")], via_run=True)
    generated, plain = read_json(tmp_path / "gen.json"), read_json(tmp_path / "plain.json")
    assert generated["masters_fp32"] and generated["masters_bitwise"] and generated["buffers_kept"]
    assert generated["losses"] == plain["losses"]
    assert generated["gathers"]["full"] == generated["num_flats"]
    assert generated["tokens"]["full"] == generated["tokens"]["per_unit"] == generated["tokens"]["budget"]
