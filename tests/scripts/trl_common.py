"""Shared pieces of the TRL/PEFT test scripts: tiny offline models, a word-level tokenizer, data, recording.

Imports only transformers / datasets / tokenizers / torch (the scripts must stay "unmodified-style": no
accel_flatshard import; the tests run them under accelerate DDP and through ``-m accel_flatshard.run``).
"""
import json

import datasets
import torch
import transformers

VOCAB, SEQ = 128, 32


def tiny_model(kind: str, seed: int = 0):
    """Untied Llama (lm_head separate from embed_tokens) or tied GPT-2, hidden 64, 2 layers."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                         eos_token_id=2, pad_token_id=0)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=SEQ, bos_token_id=1, eos_token_id=2,
                                          pad_token_id=0, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config)


def tiny_tokenizer():
    """A word-level tokenizer over tokens ``t0 .. t{VOCAB-1}`` (no hub access)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<pad>")


def random_ids(n: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, length), generator=g).tolist()


def lm_dataset(n: int, seed: int = 1):
    """Pre-tokenized language-modelling rows (``input_ids``), all of length SEQ."""
    datasets.disable_progress_bars()
    return datasets.Dataset.from_dict({"input_ids": random_ids(n, SEQ, seed)})


def preference_dataset(n: int, seed: int = 1):
    """Preference rows as text over the tiny tokenizer's words: prompt, chosen, rejected (ending in EOS)."""
    datasets.disable_progress_bars()

    def text(rows, eos=False):
        return [" ".join(f"t{i}" for i in row) + (" </s>" if eos else "") for row in rows]

    return datasets.Dataset.from_dict({
        "prompt": text(random_ids(n, 8, seed)), "chosen": text(random_ids(n, 7, seed + 1), eos=True),
        "rejected": text(random_ids(n, 7, seed + 2), eos=True),
    })


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


class LossRecorder(transformers.TrainerCallback):
    """Records the logged training loss per step and what the model looks like on this rank."""

    def __init__(self):
        self.losses, self.logs = [], []
        self.model_info = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model_info = numel_info(model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            self.logs.append(dict(logs))


def numel_info(model):
    params = list(model.parameters())
    return {"trainable": sum(p.numel() for p in params if p.requires_grad),
            "frozen": sum(p.numel() for p in params if not p.requires_grad),
            "grads": sum(p.grad.numel() for p in params if p.grad is not None),
            "class": type(model).__name__}


def write_json(path, result, accelerator_or_state):
    if accelerator_or_state.is_main_process:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
