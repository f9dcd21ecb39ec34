"""MoETransformer and ModelConfig in one process (EP=1): structure, init, dtypes, losses, statistics."""

import math

import pytest
import torch
import torch.nn.functional as F

from ep_moe.layers import ModelConfig, MoETransformer, TopKRouter

SMALL = dict(vocab_size=32, seq_length=8, num_layers=3, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24,
             moe_ffn_hidden_size=12, num_moe_experts=4, moe_router_topk=2)


def _ids(batch=2, seq=8, seed=0):
    return torch.randint(0, 32, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_structure_freq_tying_and_parameter_split():
    model = MoETransformer(ModelConfig(**SMALL, moe_layer_freq=2))
    assert [layer.moe is not None for layer in model.layers] == [True, False, True]
    assert model.output_weight is None  # tied by default
    untied = MoETransformer(ModelConfig(**SMALL, untie_embeddings_and_output_weights=True))
    assert untied.output_weight is not None and not torch.equal(untied.output_weight, untied.embedding)
    expert, other = model.expert_parameters(), model.non_expert_parameters()
    assert len(expert) == 2 * 3 and all(p.is_expert for p in expert)
    assert {id(p) for p in expert}.isdisjoint(id(p) for p in other)
    assert len(expert) + len(other) == len(list(model.parameters()))
    listed = MoETransformer(ModelConfig(**dict(SMALL, moe_layer_freq=[0, 1, 1])))
    assert [layer.moe is not None for layer in listed.layers] == [False, True, True]


def test_sm_counts_are_given_per_moe_layer_at_construction():
    model = MoETransformer(ModelConfig(**SMALL, moe_layer_freq=[1, 0, 1]), num_sms=[8, 12])
    assert [moe.num_sms for moe in model.moe_layers] == [8, 12]
    assert [moe.num_sms for moe in MoETransformer(ModelConfig(**SMALL), num_sms=16).moe_layers] == [16, 16, 16]
    with pytest.raises(ValueError, match=r"'num_sms' must be an int or one count per MoE layer \(2\), got 3"):
        MoETransformer(ModelConfig(**SMALL, moe_layer_freq=[1, 0, 1]), num_sms=[8, 12, 16])


def test_dropout_draws_in_training_only():
    ids = _ids()
    plain = MoETransformer(ModelConfig(**SMALL), seed=2)
    dropped = MoETransformer(ModelConfig(**SMALL, hidden_dropout=0.3, attention_dropout=0.3), seed=2)
    plain.eval(), dropped.eval()
    assert torch.equal(dropped(ids).logits, plain(ids).logits)  # eval: no dropout
    dropped.train()
    torch.manual_seed(0)
    first = dropped(ids).logits
    torch.manual_seed(0)
    assert torch.equal(dropped(ids).logits, first)  # the same RNG state, the same masks
    assert not torch.equal(dropped(ids).logits, first)  # the next draw differs
    with pytest.raises(ValueError, match="hidden_dropout"):
        ModelConfig(**SMALL, hidden_dropout=1.0)
    with pytest.raises(ValueError, match="attention_dropout"):
        ModelConfig(**SMALL, attention_dropout=-0.1)


def test_init_depends_on_seed_only_not_on_global_rng():
    torch.manual_seed(0)
    a = MoETransformer(ModelConfig(**SMALL), seed=5)
    state_after = torch.random.get_rng_state()
    torch.manual_seed(1)
    b = MoETransformer(ModelConfig(**SMALL), seed=5)
    c = MoETransformer(ModelConfig(**SMALL), seed=6)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.layers[0].moe.experts.w1, c.layers[0].moe.experts.w1)
    torch.manual_seed(0)
    MoETransformer(ModelConfig(**SMALL), seed=5)
    assert torch.equal(torch.random.get_rng_state(), state_after)  # the caller's RNG is left alone
    # output projections use Megatron's scaled init
    assert abs(a.layers[0].attn.wo.std().item() - 0.02 / math.sqrt(6)) < 0.004


def test_forward_loss_ignores_minus_100_and_aux_loss():
    model = MoETransformer(ModelConfig(**SMALL, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3))
    ids, labels = _ids(), _ids(seed=1)
    labels[0, :4] = -100
    out = model(ids, labels)
    assert out.logits.shape == (2, 8, 32)
    keep = labels != -100
    expected = F.cross_entropy(out.logits[keep], labels[keep])
    torch.testing.assert_close(out.loss, expected)
    routers = [m.router for m in model.moe_layers]
    torch.testing.assert_close(out.aux_loss, sum(r.aux_loss + r.z_loss for r in routers))
    assert out.aux_loss.ndim == 0 and out.aux_loss > 0
    plain = MoETransformer(ModelConfig(**SMALL))(ids)
    assert plain.loss is None and plain.aux_loss.item() == 0.0
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels[:, :4])


def test_bf16_params_and_autocast_keep_router_fp32():
    model = MoETransformer(ModelConfig(**SMALL, params_dtype="bfloat16"))
    assert model.embedding.dtype == torch.bfloat16 and model.layers[0].moe.experts.w1.dtype == torch.bfloat16
    assert model.layers[0].moe.router.weight.dtype == torch.float32
    out = model(_ids(), _ids(seed=1))
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    (out.loss + out.aux_loss).backward()
    model.float().bfloat16()
    assert model.layers[0].moe.router.weight.dtype == torch.float32

    router = TopKRouter(16, 8, 2)
    x = torch.randn(64, 16)
    want = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(x)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_training_reduces_loss_and_stats_and_expert_bias():
    torch.manual_seed(0)
    config = ModelConfig(**SMALL, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                         moe_router_bias_update_rate=1e-2)
    model = MoETransformer(config, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _ids(batch=4, seq=8, seed=3)
    labels = torch.roll(ids, -1, dims=1)
    losses = []
    for _ in range(15):
        out = model(ids, labels)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
        model.update_expert_bias()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    assert model.layers[0].moe.router.expert_bias.abs().sum() > 0
    stats = model.moe_stats()
    assert set(stats) == {"aux_loss", "z_loss", "load_imbalance", "load_imbalance_max", "load_imbalance_layers"}
    assert len(stats["load_imbalance_layers"]) == len(model.moe_layers)
    assert max(stats["load_imbalance_layers"]) == stats["load_imbalance_max"]
    assert stats["load_imbalance"] >= 1.0 and stats["load_imbalance_max"] >= stats["load_imbalance"]
    assert model.moe_stats() == {}  # reset by the previous call


@pytest.mark.parametrize("kw,field", [
    (dict(hidden_size=15), "num_attention_heads"), (dict(moe_router_topk=5), "moe_router_topk"),
    (dict(params_dtype="float16"), "params_dtype"), (dict(moe_layer_freq=0), "moe_layer_freq"),
    (dict(moe_layer_freq=[1, 0]), "moe_layer_freq"), (dict(vocab_size=0), "vocab_size"),
    (dict(moe_router_load_balancing_type="global"), "moe_router_load_balancing_type"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "moe_router_num_groups"),
    (dict(moe_router_num_groups=2), "moe_router_group_topk"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=2, moe_router_topk=1), "moe_router_group_topk"),
    (dict(moe_router_score_function="sigmoid", moe_router_pre_softmax=True), "moe_router_pre_softmax"),
])
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**dict(SMALL, **kw))
