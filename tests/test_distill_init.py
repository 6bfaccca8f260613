import pytest
import torch

from draftsmith.distill.init import existing, fresh, select_layers, shrink
from draftsmith.errors import DraftsmithError
from draftsmith.modeling import add_lora
from draftsmith.testing import tiny_llama


@pytest.fixture(scope="module")
def target4():
    return tiny_llama(seed=0, num_hidden_layers=4)


def _ids(batch=2, length=7, seed=0):
    return torch.randint(0, 384, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_select_layers():
    assert select_layers(30, 4) == [0, 10, 19, 29]
    assert select_layers(30, 1) == [0]
    assert select_layers(5, 5) == [0, 1, 2, 3, 4]
    for n_target in range(1, 40):
        for n in range(1, n_target + 1):
            layers = select_layers(n_target, n)
            assert (
                len(set(layers)) == n
                and layers == sorted(layers)
                and 0 <= layers[0]
                and layers[-1] < n_target
            )
            if n > 1:
                assert layers[0] == 0 and layers[-1] == n_target - 1
    with pytest.raises(DraftsmithError):
        select_layers(4, 5)
    with pytest.raises(DraftsmithError):
        select_layers(4, 0)


def test_shrink_copies_chosen_layers(target4):
    draft = shrink(target4, [0, 3])
    assert type(draft) is type(target4) and draft.config.num_hidden_layers == 2
    assert target4.config.num_hidden_layers == 4  # target config untouched
    for new, old in [(0, 0), (1, 3)]:
        new_sd = draft.model.layers[new].state_dict()
        old_sd = target4.model.layers[old].state_dict()
        assert new_sd.keys() == old_sd.keys()
        for k in new_sd:
            assert torch.equal(new_sd[k], old_sd[k]), k
        # attention layer index drives the KV cache slot: it must be the new position
        assert draft.model.layers[new].self_attn.layer_idx == new
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        a, b = draft.get_parameter(name), target4.get_parameter(name)
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    # copies, not shared: layers are distinct modules with distinct storage
    assert draft.model.layers[0] is not draft.model.layers[1]
    ptrs = {p.data_ptr() for p in draft.parameters()} & {p.data_ptr() for p in target4.parameters()}
    assert not ptrs
    with torch.no_grad():
        draft.model.layers[1].mlp.up_proj.weight.add_(1.0)
    assert not torch.equal(
        draft.model.layers[1].mlp.up_proj.weight, target4.model.layers[3].mlp.up_proj.weight
    )


def test_shrink_all_layers_reproduces_target(target4):
    draft = shrink(target4, range(4))
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(draft(ids).logits, target4(ids).logits, atol=1e-5)


def test_shrink_output_shapes_and_cache(target4):
    from transformers import DynamicCache

    draft = shrink(target4, [1, 2]).eval()
    ids = _ids(length=9)
    with torch.no_grad():
        full = draft(ids).logits
        assert full.shape == (2, 9, 384)
        # incremental decoding with the KV cache matches the full forward (layer indices are consistent)
        cache = DynamicCache(config=draft.config)
        draft(ids[:, :6], cache=cache, use_cache=True)
        step = draft(ids[:, 6:], cache=cache, use_cache=True).logits
    assert torch.allclose(step, full[:, 6:], atol=1e-4)


def test_shrink_save_load_round_trip(target4, tmp_path):
    from transformers import AutoModelForCausalLM

    draft = shrink(target4, [0, 2, 3]).eval()
    draft.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.num_hidden_layers == 3
    ids = _ids(seed=3)
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, draft(ids).logits, atol=1e-6)


def test_shrink_keeps_tied_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    tied = tiny_llama(seed=2, num_hidden_layers=3, tie_word_embeddings=True)
    draft = shrink(tied, [2])
    assert draft.lm_head.weight is draft.model.embed_tokens.weight
    assert torch.equal(draft.lm_head.weight, tied.lm_head.weight)
    draft.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, tied.lm_head.weight)


def test_shrink_updates_per_layer_config_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=2,
    )  # fmt: skip
    target = Qwen2ForCausalLM(config).eval()
    assert target.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    draft = shrink(target, [1, 3])
    assert draft.config.layer_types == ["full_attention", "sliding_attention"]
    assert [layer.self_attn.sliding_window for layer in draft.model.layers] == [None, 4]
    shape = draft(_ids(length=10)).logits.shape
    assert shape == (2, 10, 384)


def test_shrink_rejects_bad_layers(target4):
    for bad in ([], [0, 0], [4], [-1]):
        with pytest.raises(DraftsmithError):
            shrink(target4, bad)


def test_shrink_bf16_target_stays_bf16():
    target = tiny_llama(seed=0).to(torch.bfloat16)
    draft = shrink(target, [1])
    assert next(draft.parameters()).dtype == torch.bfloat16


def test_fresh(target4):
    draft = fresh(target4.config, hidden_size=32, num_layers=1)
    c = draft.config
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (32, 1, 384)
    # target head_dim (16) and q/kv grouping (2) kept; intermediate keeps the 2x ratio
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (2, 1, 16, 64)
    assert draft(_ids()).logits.shape == (2, 7, 384)
    assert target4.config.hidden_size == 64  # target config untouched

    donor = fresh(
        target4.config, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, copy_from=target4
    )
    assert torch.equal(donor.model.embed_tokens.weight, target4.model.embed_tokens.weight)
    assert torch.equal(donor.lm_head.weight, target4.lm_head.weight)
    assert donor.model.embed_tokens.weight.data_ptr() != target4.model.embed_tokens.weight.data_ptr()
    assert donor.config.head_dim == 32
    with pytest.raises(DraftsmithError, match="same vocab and hidden size"):
        fresh(target4.config, hidden_size=32, num_layers=1, copy_from=target4)
    with pytest.raises(DraftsmithError, match="divisible"):
        fresh(target4.config, hidden_size=30, num_layers=1, num_heads=4)


def test_existing_loads_trainable(tiny_dirs):
    draft = existing(tiny_dirs["draft"], device="cpu")
    assert draft.training and all(p.requires_grad for p in draft.parameters())
    assert draft.config.num_hidden_layers == 1


def test_add_lora_trains_only_adapters(target4):
    draft = shrink(target4, [0, 3])
    model = add_lora(draft, r=4, alpha=8)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)  # all-linear excludes the output layer
    # LoRA B is zero-initialised: the wrapped model computes exactly what the draft did
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, draft(ids).logits, atol=1e-6)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n in trainable)
    with pytest.raises(DraftsmithError):
        add_lora(draft, r=0)
