"""Bad input gets a clear typed error naming the value (models on the test device, `--device`)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fms_paged import generate, get_model, list_models
from fms_paged.models.hf import CheckpointError


def test_unknown_variant_lists_known(device):
    with pytest.raises(KeyError) as e:
        get_model(variant="13x", device=device)
    msg = str(e.value)
    assert "13x" in msg and all(v in msg for v in list_models("llama"))


def test_registry_lists_presets():
    assert {"micro", "7b", "2-7b", "3-8b"} <= set(list_models("llama"))


def test_missing_checkpoint_dir(tmp_path, device):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        get_model(model_path=tmp_path / "does-not-exist", device=device)


def test_dir_without_config(tmp_path, device):
    with pytest.raises(FileNotFoundError, match="config.json"):
        get_model(model_path=tmp_path, device=device)


def test_unreadable_config(tmp_path, device):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        get_model(model_path=tmp_path, device=device)


def test_no_weights(hf_checkpoint, device):
    _, path = hf_checkpoint("mha")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        get_model(model_path=path, device=device)


def test_unexpected_tensor_name(hf_checkpoint, device):
    _, path = hf_checkpoint("mha")
    sd = load_file(path / "model.safetensors")
    sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(sd, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="extra_proj"):
        get_model(model_path=path, device=device)


def test_wrong_tensor_shape(hf_checkpoint, device):
    _, path = hf_checkpoint("mha")
    sd = load_file(path / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(10, 64)
    save_file(sd, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"up_proj.*\(10, 64\)"):
        get_model(model_path=path, device=device)


def test_missing_tensor(hf_checkpoint, device):
    _, path = hf_checkpoint("mha")
    sd = load_file(path / "model.safetensors")
    del sd["model.norm.weight"]
    save_file(sd, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="dec_norm"):
        get_model(model_path=path, device=device)


def test_truncated_checkpoint(hf_checkpoint, device):
    """A file cut short (a copy that stopped) fails at load, naming the file, before any data is
    read: its header's offsets lie past its end."""
    _, path = hf_checkpoint("mha")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors.*data_offsets"):
        get_model(model_path=path, device=device)


def test_tensor_in_two_shards(hf_checkpoint, device):
    _, path = hf_checkpoint("mha", max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    first = load_file(path / shards[0])
    name = next(iter(first))
    last = load_file(path / shards[-1])
    last[name] = first[name]
    save_file(last, path / shards[-1])
    with pytest.raises(CheckpointError, match=f"{name}.*both"):
        get_model(model_path=path, device=device)


def test_architecture_we_do_not_load(hf_checkpoint, device):
    """An architecture no family of ours computes is refused, naming it and listing what loads; a
    model_type that contradicts the architecture is refused too."""
    from fms_paged.models.families import supported_architectures

    _, path = hf_checkpoint("mha")
    cfg = json.loads((path / "config.json").read_text())
    gpt2 = dict(cfg, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel") as e:
        get_model(model_path=path, device=device)
    assert all(a in str(e.value) for a in supported_architectures())
    (path / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    with pytest.raises(CheckpointError, match="model_type='gpt2'"):
        get_model(model_path=path, device=device)


@pytest.fixture(scope="module")
def micro(device):
    return get_model(variant="micro", device=device, max_expected_seq_len=64)


def test_prompt_too_long(micro):
    with pytest.raises(ValueError, match="prompt 1 has 70 tokens"):
        generate(micro, [[1, 2], [3] * 70], max_new_tokens=4)


def test_prompt_plus_new_tokens_too_long(micro):
    with pytest.raises(ValueError, match="max_new_tokens=10"):
        generate(micro, [[3] * 60], max_new_tokens=10)


def test_empty_prompt_list(micro):
    with pytest.raises(ValueError, match="empty"):
        generate(micro, [], max_new_tokens=4)


def test_empty_prompt(micro):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(micro, [[1], []], max_new_tokens=4)


@pytest.mark.parametrize("bad", [1.5, "7", None, True])
def test_non_integer_token(micro, bad):
    with pytest.raises(TypeError, match=r"prompt 0 token 1"):
        generate(micro, [[1, bad, 3]], max_new_tokens=4)


def test_token_out_of_vocab(micro):
    with pytest.raises(ValueError, match="256"):
        generate(micro, [[1, 256]], max_new_tokens=4)


@pytest.mark.parametrize("kw", [dict(max_new_tokens=0), dict(max_new_tokens=2, temperature=-1.0),
                                dict(max_new_tokens=2, top_p=1.5), dict(max_new_tokens=2, top_k=0)])
def test_bad_generation_args(micro, kw):
    with pytest.raises(ValueError):
        generate(micro, [[1, 2]], **kw)


def test_bad_config_values(device):
    with pytest.raises(ValueError, match="attn_impl"):
        get_model(variant="micro", device=device, attn_impl="flash")
    with pytest.raises(ValueError, match="kvheads=3"):
        get_model(variant="micro", device=device, kvheads=3)
    with pytest.raises(TypeError, match="not_a_field"):
        get_model(variant="micro", device=device, not_a_field=1)


def test_bad_device():
    with pytest.raises(ValueError, match="device"):
        get_model(variant="micro", device="tpu")
