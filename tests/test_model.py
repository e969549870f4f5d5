"""JourneyTransformer: learns, ignores padding, sees order, causal prefixes, attention export."""

from __future__ import annotations

import itertools

import polars as pl
import pytest
import torch
import torch.nn.functional as F

from journeys.config import Model
from journeys.encoding import JourneyEncoder, model_config_from, model_config_from_sizes
from journeys.model import JourneyTransformer, ModelConfig, PiecewiseLinearInputs, attention_rollout
from journeys.vocab import Vocabularies, Vocabulary

VOCAB, FEATURES, BUCKETS, MAX_LEN = 12, (5, 4), 8, 24
CONTINUOUS = ModelConfig(vocab_size=VOCAB).n_continuous  # the default model's inputs


def tiny(scramble: bool = True, **overrides) -> JourneyTransformer:
    settings = dict(
        vocab_size=VOCAB,
        feature_vocab_sizes=FEATURES,
        n_time_buckets=BUCKETS,
        d_model=16,
        n_heads=2,
        n_layers=2,
        dropout=0.0,
        max_len=MAX_LEN,
    )
    settings.update(overrides)
    if settings.get("causal") and "position_origin" not in overrides:
        settings["position_origin"] = "start"  # as the product's `auto` resolves it
    torch.manual_seed(0)
    model = JourneyTransformer(ModelConfig(**settings)).eval()
    if scramble:
        # At initialisation the output barely depends on the input (small weights), which
        # would let "unchanged" tests pass trivially; a rougher random function does not.
        # Padding rows become non-zero too, so masking alone must hide padding.
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(std=0.3 if param.dim() > 1 else 0.1)
    return model


def batch(lengths: list[int], width: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random right-padded journeys: ids >= 2 on real events, 0 on padding."""
    generator = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    tokens = torch.randint(2, VOCAB, (len(lengths), width), generator=generator)
    features = torch.stack(
        [torch.randint(2, size, (len(lengths), width), generator=generator) for size in FEATURES],
        dim=1,
    )
    time_buckets = torch.randint(1, BUCKETS, (len(lengths), width), generator=generator)
    # The default model reads the time encodings: random ones, zero on padding.
    continuous = torch.randn(len(lengths), CONTINUOUS, width, generator=generator)
    return {
        "tokens": tokens * mask,
        "features": features * mask[:, None, :],
        "time_buckets": time_buckets * mask,
        "mask": mask,
        "continuous": continuous * mask[:, None, :],
    }


def pad(inputs: dict[str, torch.Tensor], extra: int) -> dict[str, torch.Tensor]:
    return {name: F.pad(value, (0, extra)) for name, value in inputs.items()}


VARIANTS = [
    dict(pooling="cls"),
    dict(pooling="mean"),
    dict(pooling="last"),
    dict(causal=True),
    dict(pooling="cls", position_origin="end"),
    dict(pooling="mean", position_origin="end", positional="learned"),
    dict(pooling="cls", position_origin="end", visit_bucket=4),
    dict(causal=True, visit_bucket=4),
    dict(pooling="last", wide=True),
    dict(causal=True, wide=True),
]
NORMS = ["pre", "post"]
LENGTHS = [5, 1, 9, 3]


def test_tiny_model_overfits_a_tiny_batch() -> None:
    model = tiny(scramble=False, d_model=32).train()
    inputs = batch([6, 3, 8, 2, 7, 5, 4, 8] * 2, seed=1)
    labels = (torch.arange(16) % 2).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(120):
        loss = F.binary_cross_entropy_with_logits(model(**inputs).logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.02


@pytest.mark.parametrize(("variant", "norm"), list(itertools.product(VARIANTS, NORMS)))
def test_extra_padding_leaves_outputs_unchanged(variant: dict, norm: str) -> None:
    model = tiny(norm=norm, **variant)
    inputs = batch(LENGTHS)
    padded = pad(inputs, 6)
    for attention in (None, "pooled", "rollout"):
        short = model(**inputs, attention=attention)
        long = model(**padded, attention=attention)
        torch.testing.assert_close(long.logits, short.logits, atol=1e-5, rtol=1e-5)
        if attention:
            torch.testing.assert_close(long.attention[:, : max(LENGTHS)], short.attention)
            assert long.attention[:, max(LENGTHS) :].abs().sum() == 0
        if model.config.causal:
            real = inputs["mask"]
            torch.testing.assert_close(
                long.prefix_logits[:, : max(LENGTHS)][real], short.prefix_logits[real]
            )


@pytest.mark.parametrize("variant", [*VARIANTS, dict(positional="learned")])
def test_event_order_changes_the_logits(variant: dict) -> None:
    model = tiny(**variant)
    inputs = batch([7, 7, 7])
    reversed_inputs = {name: value.flip(-1) for name, value in inputs.items()}
    original = model(**inputs).logits
    permuted = model(**reversed_inputs).logits
    assert (original - permuted).abs().min() > 1e-4


def test_positions_from_the_end_give_the_last_events_the_same_ids() -> None:
    """Counted from the end, the last event has one id whatever the journey's length."""
    model = tiny(position_origin="end", pooling="last", positional="learned")
    lengths = torch.tensor([5, 1, 9])
    ids = model._positions(lengths, 9)
    last = ids.gather(1, (lengths - 1)[:, None]).squeeze(1)
    assert last.tolist() == [0, 0, 0]
    assert ids[2].tolist() == list(range(8, -1, -1))
    with_cls = tiny(position_origin="end", pooling="cls")._positions(lengths, 10)
    assert with_cls[:, 0].tolist() == [0, 0, 0]  # the CLS token
    assert with_cls.gather(1, lengths[:, None]).squeeze(1).tolist() == [1, 1, 1]
    start = tiny(position_origin="start")._positions(lengths, 9)  # one row for all
    assert start.tolist() == list(range(9))
    with pytest.raises(ValueError, match="causal"):
        tiny(causal=True, position_origin="end")


def test_every_event_carries_the_gap_that_opened_its_visit() -> None:
    model = tiny(visit_bucket=4)
    time_buckets = torch.tensor([[1, 2, 5, 3, 2, 7, 1, 0, 0]])  # BUCKETS = 8
    mask = time_buckets > 0
    # visits open at event 0 (bucket 1), at the 5 and at the 7; padding stays 0
    expected = [[1, 1, 5, 5, 5, 7, 7, 0, 0]]
    assert model.visit_gaps(time_buckets, mask).tolist() == expected
    # the embedding changes the output: same events, another gap before the last visit
    inputs = batch([6, 6], seed=3)
    inputs["time_buckets"][:, :] = torch.tensor([1, 2, 2, 7, 2, 2])
    other = {**inputs, "time_buckets": inputs["time_buckets"].clone()}
    other["time_buckets"][:, 3] = 6
    assert (model(**inputs).logits - model(**other).logits).abs().min() > 1e-4


def test_without_positions_mean_pooling_is_order_blind() -> None:
    """The control for the test above: it would catch a model that cannot see order."""
    # Nor visits: the gap that opened the first visit is on every event, so it sees order.
    model = tiny(positional="none", pooling="mean", visit_bucket=None)
    inputs = batch([7, 7, 7])
    reversed_inputs = {name: value.flip(-1) for name, value in inputs.items()}
    torch.testing.assert_close(model(**reversed_inputs).logits, model(**inputs).logits)


@pytest.mark.parametrize(("norm", "wide"), [("pre", False), ("post", False), ("pre", True)])
def test_causal_prefix_logits_ignore_later_events(norm: str, wide: bool) -> None:
    model = tiny(causal=True, norm=norm, wide=wide)
    inputs = batch([9, 9, 6], seed=2)
    out = model(**inputs)
    assert out.prefix_logits.shape == inputs["mask"].shape
    torch.testing.assert_close(out.logits, out.prefix_logits[torch.arange(3), [8, 8, 5]])

    k = 3
    changed = batch([9, 9, 6], seed=3)
    altered = {name: value.clone() for name, value in inputs.items()}
    for name in ("tokens", "time_buckets", "features"):
        altered[name][..., k + 1 :] = changed[name][..., k + 1 :]
    altered_out = model(**altered)
    assert not torch.allclose(altered_out.logits, out.logits)
    torch.testing.assert_close(altered_out.prefix_logits[:, : k + 1], out.prefix_logits[:, : k + 1])

    for cut in range(6):
        truncated = {name: value[..., : cut + 1] for name, value in inputs.items()}
        torch.testing.assert_close(
            model(**truncated).logits, out.prefix_logits[:, cut], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(
    ("variant", "norm", "attention"),
    list(itertools.product(VARIANTS, NORMS, ["pooled", "rollout"])),
)
def test_explicit_attention_path_matches_fast_path(variant: dict, norm: str, attention) -> None:
    model = tiny(norm=norm, n_layers=3, **variant)
    inputs = batch(LENGTHS, width=12)
    fast = model(**inputs)
    explicit = model(**inputs, attention=attention)
    assert fast.attention is None
    torch.testing.assert_close(explicit.logits, fast.logits, atol=1e-5, rtol=1e-5)
    if model.config.causal:
        torch.testing.assert_close(explicit.prefix_logits, fast.prefix_logits, atol=1e-5, rtol=1e-5)

    weights = explicit.attention
    mask = inputs["mask"]
    assert weights.shape == mask.shape  # the CLS position is not exported
    assert (weights >= 0).all()
    assert (weights[~mask] == 0).all()
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(len(LENGTHS)))
    assert (weights[mask] > 0).all()


def test_pooled_attention_is_the_cls_row_of_the_last_layer() -> None:
    """Recompute the CLS row by hand from the last block's input: the export must match."""
    model = tiny(n_layers=2, pooling="cls")
    inputs = batch([4, 2], width=5)
    captured = {}
    block = model.blocks[-1]
    handle = block.register_forward_pre_hook(lambda _m, args: captured.update(x=args[0]))
    exported = model(**inputs, attention="pooled").attention
    handle.remove()
    x = block.ln_1(captured["x"])
    q, k, _ = block.attn.qkv(x).split(model.config.d_model, dim=2)
    q, k = (t.view(2, 6, 2, 8).transpose(1, 2) for t in (q, k))
    keys = torch.cat([torch.ones(2, 1, dtype=torch.bool), inputs["mask"]], dim=1)
    scores = (q[:, :, :1] @ k.transpose(-2, -1)) / 8**0.5
    row = scores.masked_fill(~keys[:, None, None, :], float("-inf")).softmax(-1).mean(1)[:, 0]
    expected = row[:, 1:] / row[:, 1:].sum(dim=1, keepdim=True)
    torch.testing.assert_close(exported, expected)


def test_rollout_multiplies_identity_mixed_maps() -> None:
    uniform = torch.full((1, 2, 2), 0.5)
    one = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    torch.testing.assert_close(attention_rollout([one]), one)
    # (A + I) / 2 for a uniform map, then squared
    layer = torch.tensor([[[0.75, 0.25], [0.25, 0.75]]])
    torch.testing.assert_close(attention_rollout([uniform, uniform]), layer @ layer)


def test_empty_journey_gives_finite_outputs() -> None:
    for variant in VARIANTS:
        model = tiny(**variant)
        inputs = batch([3, 1])
        inputs = {name: value * 0 for name, value in inputs.items()}
        inputs["mask"] = inputs["mask"].bool()
        out = model(**inputs, attention="rollout")
        assert torch.isfinite(out.logits).all()
        assert torch.isfinite(out.attention).all()


def test_config_from_settings_round_trips_and_weights_reload() -> None:
    vocabs = Vocabularies(
        by_column={
            "event_type": Vocabulary(("<pad>", "<unk>", "view", "click")),
            "channel": Vocabulary(("<pad>", "<unk>", "search")),
            "device": Vocabulary(("<pad>", "<unk>", "mobile", "desktop", "tv")),
        }
    )
    settings = Model(d_model=16, n_heads=2)
    encoder = JourneyEncoder.fit(pl.DataFrame(), vocabs, settings, max_len=MAX_LEN, timezone="UTC")
    config = model_config_from(settings, encoder)
    assert (config.vocab_size, config.feature_vocab_sizes) == (4, (3, 5))
    assert (config.max_len, config.n_time_buckets) == (MAX_LEN, settings.time_buckets)
    assert ModelConfig.from_dict(config.to_dict()) == config

    model = tiny()
    clone = JourneyTransformer(ModelConfig.from_dict(model.config.to_dict())).eval()
    clone.load_state_dict(model.state_dict())
    inputs = batch(LENGTHS)
    torch.testing.assert_close(clone(**inputs).logits, model(**inputs).logits)
    probabilities = torch.sigmoid(model(**inputs).logits)
    assert ((probabilities > 0) & (probabilities < 1)).all()


def test_padding_embeddings_start_at_zero_and_too_long_input_is_refused() -> None:
    model = tiny(scramble=False)
    assert model.event_embedding.weight[0].abs().sum() == 0
    assert model.time_embedding.weight[0].abs().sum() == 0
    with pytest.raises(ValueError, match="max_len"):
        model(**batch([MAX_LEN + 1]))


def test_attention_dropout_drops_attention_weights_in_training_only() -> None:
    inputs = batch(LENGTHS)
    plain = tiny().train()  # dropout 0 and attention_dropout 0: nothing random
    torch.testing.assert_close(plain(**inputs).logits, plain(**inputs).logits)
    dropping = tiny(attention_dropout=0.5).train()  # same weights (same seed)
    torch.manual_seed(1)
    first = dropping(**inputs).logits
    torch.manual_seed(2)
    assert not torch.allclose(first, dropping(**inputs).logits)
    torch.testing.assert_close(dropping.eval()(**inputs).logits, plain.eval()(**inputs).logits)
    settings = Model(d_model=16, n_heads=2, attention_dropout=0.2)
    sizes = dict(feature_vocab_sizes=FEATURES, n_time_buckets=BUCKETS, n_continuous=0)
    config = model_config_from_sizes(settings, vocab_size=VOCAB, max_len=MAX_LEN, **sizes)
    assert config.attention_dropout == 0.2


def hour_journeys(n: int, seed: int):
    """Journeys whose conversion depends on the local hour of their last event alone (late
    evening converts), with event types and gaps drawn the same for everyone."""
    from datetime import UTC, datetime, timedelta

    import numpy as np
    import polars as pl

    rng = np.random.default_rng(seed)
    start = datetime(2026, 1, 5, tzinfo=UTC)
    rows = []
    for _ in range(n):
        length = int(rng.integers(2, 6))
        offsets = np.cumsum(np.r_[0.0, rng.exponential(600.0, length - 1)])
        offsets += rng.uniform(0, 14 * 86400)
        times = [start + timedelta(seconds=float(s)) for s in offsets]
        rows.append(
            {
                "event_type": rng.choice(["view", "click"], length).tolist(),
                "event_time": times,
                "label": int(times[-1].hour >= 20),
            }
        )
    return pl.DataFrame(rows, schema_overrides={"event_time": pl.List(pl.Datetime("us", "UTC"))})


def fit_and_test_auc(model: JourneyTransformer, train, test, epochs: int) -> float:
    """A few epochs of plain AdamW on `train` (EncodedJourneys), then test ROC AUC."""
    from sklearn.metrics import roc_auc_score

    from journeys.encoding import make_dataloader
    from journeys.inference import run_model

    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for batch in make_dataloader(train, 64, shuffle=True, group_by_length=False):
            out = model(
                batch.tokens, batch.features, batch.time_buckets, batch.mask,
                continuous=batch.continuous,
            )  # fmt: skip
            loss = F.binary_cross_entropy_with_logits(out.logits, batch.labels)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return float(roc_auc_score(test.labels.numpy(), run_model(model, test, 256).logits))


@pytest.mark.parametrize("time_encodings", [False, True])
def test_time_encodings_let_the_model_learn_the_hour_of_day(time_encodings: bool) -> None:
    """The hour of day is invisible to gap buckets: a model learns a conversion that
    depends on it only with `model.time_encodings` (AUC ~0.5 without, near 1 with)."""
    vocabs = Vocabularies(by_column={"event_type": Vocabulary(("<pad>", "<unk>", "view", "click"))})
    settings = Model(d_model=16, n_heads=2, n_layers=1, time_encodings=time_encodings)
    encoder = JourneyEncoder.fit(pl.DataFrame(), vocabs, settings, max_len=8, timezone="UTC")
    torch.manual_seed(0)
    model = JourneyTransformer(model_config_from(settings, encoder))
    train = encoder.encode(hour_journeys(3000, seed=0))
    test = encoder.encode(hour_journeys(1000, seed=1))
    auc = fit_and_test_auc(model, train, test, epochs=3)
    if time_encodings:
        assert auc > 0.9
    else:
        assert auc < 0.65


def test_a_model_with_continuous_inputs_needs_them() -> None:
    config = ModelConfig(vocab_size=5, n_heads=2, d_model=16, n_continuous=3, max_len=4)
    model = JourneyTransformer(config)
    tokens, mask = torch.tensor([[2, 3, 0]]), torch.tensor([[True, True, False]])
    features, buckets = torch.zeros(1, 0, 3, dtype=torch.long), torch.tensor([[1, 2, 0]])
    with pytest.raises(ValueError, match="continuous"):
        model(tokens, features, buckets, mask)
    continuous = torch.randn(1, 3, 3)
    summed = model.event_embeddings(tokens, features, buckets, mask, continuous)
    assert (summed[0, 2] == 0).all()  # padding stays zero: no bias leaks in


def test_piecewise_inputs_start_as_the_projection_and_fit_quantile_edges() -> None:
    model = tiny(scramble=False, continuous_encoding="piecewise", continuous_bins=8)
    piecewise = model.continuous_projection
    assert isinstance(piecewise, PiecewiseLinearInputs)
    with pytest.raises(ValueError, match="fit_edges"):  # edges never fitted: refused
        model(**batch(LENGTHS))
    values = torch.rand(CONTINUOUS, 4000, generator=torch.Generator().manual_seed(0))
    values[0, :2000] = 0.0  # half the events at one value (every first event's age)
    values[1] = (values[1] * 3).floor()  # three distinct values only
    values[3, :100] = float("nan")  # missing values do not count
    piecewise.fit_edges(values)
    assert piecewise.edges.isfinite().all()
    torch.testing.assert_close(
        piecewise.edges[3], torch.quantile(values[3, 100:], torch.linspace(0, 1, 9))
    )
    edges = piecewise.edges
    assert (edges[:, 1:] >= edges[:, :-1]).all()
    # The shared value is one edge; the other bins spread over the rest of the values.
    assert edges[0, 0] == 0 and (edges[0, 1:] > 0).all() and edges[0, 1] < 0.2
    assert edges[1].unique().tolist() == [0.0, 1.0, 2.0]  # then bins of zero width: steps
    torch.testing.assert_close(edges[2], torch.quantile(values[2], torch.linspace(0, 1, 9)))
    x = torch.randn(3, 5, CONTINUOUS)
    torch.testing.assert_close(piecewise(x), piecewise.linear(x))  # the bins start at zero
    # Saved with the weights: a clone that loads the state dict has the fitted edges.
    clone = JourneyTransformer(ModelConfig.from_dict(model.config.to_dict()))
    clone.load_state_dict(model.state_dict())
    torch.testing.assert_close(clone.continuous_projection.edges, edges)
