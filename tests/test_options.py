"""The options module: README table equals the declarations; unknown names and bad values fail on every path."""
import os
import re

import pytest
import torch.nn as nn

from accel_flatshard import FullyShardedDataParallel, options

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_table_is_the_options_module():
    with open(README) as f:
        text = f.read()
    match = re.search(r"<!-- options-table -->\n(.*?)\n<!-- /options-table -->", text, re.S)
    assert match, "README.md lost the <!-- options-table --> markers"
    assert match.group(1) == options.markdown_table()
    # every option appears in it once, and nothing else
    assert re.findall(r"^\| `(FLATSHARD_\w+)`", match.group(1), re.M) == list(options.OPTIONS)


def test_defaults_and_parsing(monkeypatch):
    for name in options.OPTIONS:
        monkeypatch.delenv(name, raising=False)
    assert options.get("FLATSHARD_TIMEOUT_S") == 1800.0
    assert options.get("FLATSHARD_STATE_DICT_TIMEOUT_S") == 5.0
    assert options.get("FLATSHARD_REDUCE_SCATTER_VIA_ALL_REDUCE") is False  # the one default (comm.py uses it)
    assert options.get("FLATSHARD_GLOO_P2P") is None  # auto: on with gloo
    assert options.get("FLATSHARD_PROFILE") is None and options.get("FLATSHARD_PROFILE_EVERY") == 10
    monkeypatch.setenv("FLATSHARD_GLOO_P2P", "off")
    monkeypatch.setenv("FLATSHARD_PROFILE", "1")
    monkeypatch.setenv("FLATSHARD_REDUCE_DTYPE", "BF16")
    assert options.get("FLATSHARD_GLOO_P2P") is False and options.get("FLATSHARD_PROFILE") == ""
    monkeypatch.setenv("FLATSHARD_PROFILE", "/tmp/x")
    assert options.get("FLATSHARD_PROFILE") == "/tmp/x" and str(options.get("FLATSHARD_REDUCE_DTYPE")) == "torch.bfloat16"
    assert options.env_flag("FLATSHARD_GLOO_P2P") is False and options.env_flag("NOT_SET_ANYWHERE_123") is False
    monkeypatch.setenv("SOME_FLAG", " Yes ")
    assert options.env_flag("SOME_FLAG") is True


@pytest.mark.parametrize("name,value,allowed", [
    ("FLATSHARD_GLOO_P2P", "maybe", "1, true"),
    ("FLATSHARD_TIMEOUT_S", "-3", "positive number"),
    ("FLATSHARD_PROFILE_EVERY", "ten", "positive integer"),
    ("FLATSHARD_REDUCE_DTYPE", "fp8", "fp32, bf16, fp16"),
])
def test_bad_value_fails_on_the_plain_wrapper(world_of_one, monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        FullyShardedDataParallel(nn.Linear(4, 4))
    message = str(info.value)
    assert f"{name}={value!r}" in message and allowed in message


def test_unknown_name_fails_on_the_plain_wrapper(world_of_one, monkeypatch):
    monkeypatch.setenv("FLATSHARD_GRUOP_SIZE", "2")
    with pytest.raises(ValueError, match=r"(?s)FLATSHARD_GRUOP_SIZE.*known ones.*FLATSHARD_GROUP_SIZE"):
        FullyShardedDataParallel(nn.Linear(4, 4))
    monkeypatch.delenv("FLATSHARD_GRUOP_SIZE")
    model = FullyShardedDataParallel(nn.Linear(4, 4))  # and without it the same call works
    assert model.flat_params
