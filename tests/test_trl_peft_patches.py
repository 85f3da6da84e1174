"""The library functions that must see through accel_flatshard's wrapper (integrations/trainer_trl_peft.py, installed by patches.py)."""
import torch.nn as nn

from accel_flatshard import FullyShardedDataParallel
from accel_flatshard.integrations import patches
from dist_helpers import spawn
from models import llama


def _unwrap_worker(rank, world_size):
    import accelerate.utils
    import transformers.modeling_utils
    from peft import LoraConfig, get_peft_model

    patches.install()
    model = get_peft_model(llama(), LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    wrapped = FullyShardedDataParallel(model)
    return {
        "extract": accelerate.utils.extract_model_from_parallel(wrapped) is model,
        "is_peft_model": accelerate.utils.is_peft_model(wrapped),
        "transformers_unwrap": transformers.modeling_utils.unwrap_model(wrapped) is model,
        "plain_model_unchanged": accelerate.utils.extract_model_from_parallel(model) is model,
    }


def test_accelerate_and_transformers_unwrap_the_wrapper_and_see_peft():
    assert spawn(1, _unwrap_worker)[0] == {"extract": True, "is_peft_model": True, "transformers_unwrap": True,
                                           "plain_model_unchanged": True}


class _FakeFlatshardAccelerator:
    flatshard_options = object()  # what our Accelerator exposes when it shards

    def __init__(self):
        self.calls = []

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        self.calls.append(evaluation_mode)
        return model


def test_trl_prepare_fsdp_in_trainer_modules_shards_the_reference_with_our_accelerator():
    import trl.models.utils
    import trl.trainer.dpo_trainer as dpo_trainer

    patches.install()
    accelerator, reference = _FakeFlatshardAccelerator(), nn.Linear(2, 2)
    assert dpo_trainer.prepare_fsdp(reference, accelerator) is reference
    assert accelerator.calls == [True] and not reference.training
    # other accelerators still get TRL's own function
    assert dpo_trainer.prepare_fsdp.__wrapped__.__module__ == "trl.models.utils"
    assert trl.models.utils.prepare_fsdp is dpo_trainer.prepare_fsdp
