"""The conversion transformer: a journey of events in, one conversion logit out.

Everything the model does is in this file, in the spirit of nanoGPT's `model.py`:

- each event is the sum of embeddings of its event type, each categorical feature, the
  time since the previous event (bucketed by `journeys.inputs.TimeInput`) and the gap that
  opened its visit (the latest gap of at least `visit_bucket`), plus a linear projection of
  its `n_continuous` continuous inputs (time encodings, the journey so far, numeric features; with
  `continuous_encoding` "periodic" or "piecewise" each input also through features of its
  own); id 0 is padding everywhere;
  `journeys.encoding.model_config_from` sizes the `ModelConfig` from the fitted encoder
  (its per-event inputs, `journeys.inputs`) and the `model` section's architecture;
- a positional encoding (fixed sinusoid, learned table, or none) is added;
- `n_layers` transformer blocks (self-attention + GELU feed-forward, pre- or post-norm);
- the journey is pooled (a prepended CLS token, the mean of real events, or the last real
  event) and a linear head gives one logit;
- with `wide=True`, a wide part (Wide & Deep, Cheng et al. 2016) adds a logit of its own
  from journey-level aggregates: the mean and the maximum of the events' summed embeddings
  and the journey's length. Gradient boosting on such aggregates (counts, gaps, duration)
  wins on many real ad logs, and attention reaches them only one event at a time.

With `causal=True` every position sees only itself and earlier events, the head runs at
every position, and one pass gives the logit after each event (in-flight scoring); the
journey logit is the one at its last event. Causal models pool at the last event whatever
`pooling` says, and have no CLS token.

Sequences are right-padded: real events first, `mask` True on them.

Attention for attribution: `forward(..., attention="pooled" | "rollout")` returns one weight
per event (zero on padding, summing to 1). The default fast path uses
`F.scaled_dot_product_attention`, which returns no weights, so weights are recomputed
explicitly only where asked: for "pooled" just the pooled query row(s) of the last layer,
for "rollout" the full maps of every layer (Abnar & Zuidema 2020).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Positional = Literal["sinusoidal", "learned", "none"]
ContinuousEncoding = Literal["linear", "periodic", "piecewise"]
PositionOrigin = Literal["start", "end"]
Norm = Literal["pre", "post"]
Pooling = Literal["cls", "mean", "last"]
AttentionMode = Literal["pooled", "rollout"]

INIT_STD = 0.02  # nanoGPT / GPT-2 initialisation of linear layers


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of `JourneyTransformer`; plain values so it round-trips through JSON.

    The defaults are the product's (`journeys.config.Model` and `Journey`, with time
    encodings on and no numeric feature): a model built here is the one the product ships
    (a test keeps them equal). Only the vocabulary sizes have none: they come from the data.
    """

    vocab_size: int
    feature_vocab_sizes: tuple[int, ...] = ()
    n_time_buckets: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.0  # on the summed embeddings and on each residual branch
    attention_dropout: float = 0.0  # on the attention weights
    positional: Positional = "sinusoidal"
    position_origin: PositionOrigin = "end"
    norm: Norm = "pre"
    pooling: Pooling = "last"
    causal: bool = False
    max_len: int = 64
    # Time buckets >= this one open a visit (11: the product's 30 minutes with 32 buckets);
    # None: no visit-gap embedding.
    visit_bucket: int | None = 11
    # Continuous inputs per event, projected and added (6: the time encodings); 0: none.
    n_continuous: int = 6
    # A wide part beside the sequence (`WidePart`): journey aggregates -> a logit of its own.
    wide: bool = False
    # How the continuous inputs enter: one linear projection of them all, each through
    # periodic features of learned frequencies (`PeriodicInputs`), or the projection plus
    # each input's piecewise-linear encoding over `continuous_bins` train-quantile bins
    # (`PiecewiseLinearInputs`).
    continuous_encoding: ContinuousEncoding = "linear"
    continuous_bins: int = 64
    periodic_frequencies: int = 16
    periodic_sigma: float = 4.0  # the frequencies' initial spread (cycles per unit of input)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        for name, allowed in (
            ("positional", get_args(Positional)),
            ("position_origin", get_args(PositionOrigin)),
            ("norm", get_args(Norm)),
            ("pooling", get_args(Pooling)),
            ("continuous_encoding", get_args(ContinuousEncoding)),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, not {getattr(self, name)!r}")
        if self.causal and self.position_origin == "end":
            # a prefix's distance to the journey's end is not known while it is in flight
            raise ValueError("a causal model counts positions from the start")
        object.__setattr__(self, "feature_vocab_sizes", tuple(self.feature_vocab_sizes))

    @property
    def uses_cls(self) -> bool:
        return self.pooling == "cls" and not self.causal

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["feature_vocab_sizes"] = list(self.feature_vocab_sizes)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return cls(**{**data, "feature_vocab_sizes": tuple(data.get("feature_vocab_sizes", ()))})


class ModelOutput(NamedTuple):
    """`logits` [B]; `prefix_logits` [B, L] after each event (causal models only; values at
    padded positions are finite but meaningless); `attention` [B, L] when asked for."""

    logits: Tensor
    prefix_logits: Tensor | None = None
    attention: Tensor | None = None


def sinusoidal_table(length: int, d_model: int) -> Tensor:
    """Vaswani et al. (2017): PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(1e4) / d_model)
    )
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)[:, : d_model // 2]
    return table


class SelfAttention(nn.Module):
    """Multi-head self-attention; `mask` is bool, True = may attend (SDPA's convention)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.attention_dropout = config.attention_dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: Tensor, mask: Tensor, rows: Tensor | None = None, full: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """x [B, L, D], mask [B, 1, 1 or L, L] -> (output [B, L, D], weights or None).

        `full`: compute the whole [B, H, L, L] weight map explicitly and use it for the output.
        `rows` [B, R]: besides the fast output, the weights [B, H, R, L] of those query rows.
        """
        batch, length, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=2)
        # [B, L, D] -> [B, H, L, D/H]
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.attention_dropout if self.training else 0.0
        weights = None
        if full:
            weights = _softmax_weights(q, k, mask)
            y = F.dropout(weights, dropout_p, self.training) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
            if rows is not None:
                index = rows[:, None, :, None]
                q_rows = q.gather(2, index.expand(-1, q.size(1), -1, q.size(3)))
                if mask.size(2) > 1:  # causal: each row has its own mask
                    mask = mask.gather(2, index.expand(-1, 1, -1, mask.size(3)))
                weights = _softmax_weights(q_rows, k, mask)
        y = y.transpose(1, 2).reshape(batch, length, d_model)
        return self.resid_dropout(self.proj(y)), weights


def _softmax_weights(q: Tensor, k: Tensor, mask: Tensor) -> Tensor:
    """softmax(Q K^T / sqrt(d)) with disallowed keys at -inf: the weights SDPA uses."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Attention and feed-forward sub-layers, each with a residual and a LayerNorm.

    Pre-norm (LN inside the residual branch) trains stably without warm-up tricks; post-norm
    (LN after the residual sum) is the original 2017 layout.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pre_norm = config.norm == "pre"
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.ffn = FeedForward(config)

    def forward(
        self, x: Tensor, mask: Tensor, rows: Tensor | None = None, full: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        if self.pre_norm:
            attended, weights = self.attn(self.ln_1(x), mask, rows, full)
            x = x + attended
            return x + self.ffn(self.ln_2(x)), weights
        attended, weights = self.attn(x, mask, rows, full)
        x = self.ln_1(x + attended)
        return self.ln_2(x + self.ffn(x)), weights


class PeriodicInputs(nn.Module):
    """Continuous inputs [B, L, C] -> [B, L, D]: each input through sin and cos of learned
    frequencies, a linear map of its own and a ReLU, summed over inputs (the PLR embedding
    of Gorishniy et al. 2022, "On Embeddings for Numerical Features in Tabular Deep
    Learning").

    Why: a linear projection gives each input one direction, so a sharp or non-monotone
    effect (conversions at a journey age of a week but not of two days) takes the blocks
    many steps to carve out; periodic features let one layer place it.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inputs, k, d_model = config.n_continuous, config.periodic_frequencies, config.d_model
        self.frequencies = nn.Parameter(torch.empty(inputs, k))
        self.weight = nn.Parameter(torch.empty(inputs, 2 * k, d_model))
        self.bias = nn.Parameter(torch.zeros(inputs, d_model))

    def forward(self, x: Tensor) -> Tensor:
        angles = 2 * math.pi * x[..., None] * self.frequencies  # [B, L, C, K]
        periodic = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
        per_input = torch.einsum("blck,ckd->blcd", periodic, self.weight) + self.bias
        return F.relu(per_input).sum(dim=2)


class PiecewiseLinearInputs(nn.Module):
    """Continuous inputs [B, L, C] -> [B, L, D]: one linear projection of them all, plus each
    input's piecewise-linear encoding over bins of its train quantiles through a map of its
    own (the PLE of Gorishniy et al. 2022), which starts at zero.

    Why: a sharp effect of one duration (on Criteo's journeys every journey older than about
    3.15 days converted, and few younger ones) needs a slope that a projection reaches only
    with huge weights; each bin's ramp puts a knot where the train data are dense, as a
    booster's histogram bins do. Starting at zero, the model begins as the projection alone
    and grows the bins only where they help. The edges are a buffer, fitted on the train
    split by `fit_edges` before training and saved with the weights.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inputs, bins, d_model = config.n_continuous, config.continuous_bins, config.d_model
        self.linear = nn.Linear(inputs, d_model)
        # NaN until `fit_edges`: a model whose edges were never fitted refuses to run.
        self.register_buffer("edges", torch.full((inputs, bins + 1), math.nan))
        self.weight = nn.Parameter(torch.zeros(inputs, bins, d_model))
        self._checked = False

    @torch.no_grad()
    def fit_edges(self, values: Tensor, max_values: int = 1 << 22, seed: int = 0) -> None:
        """Edges from `values` [C, N] (every train event's inputs): each input's quantiles
        over its finite values (a seeded sample of `max_values` on larger logs: every rank
        draws the same).

        A value many events share (0 s since the journey's start on every first event) is
        one edge, and the bins it would have taken go to finer quantiles of the rest; an
        input with fewer distinct values than edges ends in bins of zero width, each a step.
        """
        n_edges = self.edges.size(1)
        if values.size(1) > max_values:  # torch.quantile takes 16M values at most
            generator = torch.Generator().manual_seed(seed)
            values = values[:, torch.randint(values.size(1), (max_values,), generator=generator)]
        levels = torch.linspace(0, 1, n_edges, device=values.device).double()
        finer = torch.linspace(0, 1, 16 * n_edges, device=values.device).double()
        for i, row in enumerate(values.double()):
            row = row[row.isfinite()]
            if not row.numel():
                raise ValueError(f"continuous input {i} has no finite value to fit bins on")
            edges = torch.quantile(row, levels).unique()
            if edges.numel() < n_edges:
                dense = torch.quantile(row, finer).unique()
                pick = torch.linspace(0, dense.numel() - 1, min(n_edges, dense.numel()))
                edges = dense[pick.round().long().to(dense.device)]
            padded = torch.cat([edges, edges[-1:].expand(n_edges - edges.numel())])
            self.edges[i] = padded.to(self.edges)

    def forward(self, x: Tensor) -> Tensor:
        if not self._checked:
            if self.edges.isnan().any():
                raise ValueError(
                    "piecewise inputs without edges: call fit_edges on the train split"
                )
            self._checked = True
        left = self.edges[:, :-1]
        width = self.edges[:, 1:] - left
        offset = x[..., None] - left  # [B, L, C, K]
        ramp = (offset / width.clamp(min=1e-12)).clamp(0.0, 1.0)
        encoded = torch.where(width > 0, ramp, (offset >= 0).to(x.dtype))
        return self.linear(x) + encoded.flatten(-2) @ self.weight.flatten(0, 1)


class WidePart(nn.Module):
    """Journey-level aggregates -> a logit added to the sequence's (Wide & Deep).

    It reads the events' summed embeddings, the blocks' own input before positions: their
    mean (a bag of event types, features and time encodings, as shares), their maximum
    (the longest gap, the latest hour, any rare event present) and the log of the length,
    through a small MLP. Reading the same sum as the blocks keeps integrated gradients
    exact: the gradient with respect to any one embedding table's output is still the
    gradient with respect to the sum. Causal models get the aggregates of every prefix.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d_model = config.d_model
        self.log_max_len = math.log1p(config.max_len)
        self.fc = nn.Linear(2 * d_model + 1, d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.out = nn.Linear(d_model, 1)

    def forward(self, events: Tensor, mask: Tensor, causal: bool) -> Tensor:
        """events [B, L, D], mask [B, L] -> logits [B, L] (causal: per prefix) or [B]."""
        real = mask[..., None]
        if causal:
            count = real.cumsum(dim=1)
            total = (events * real).cumsum(dim=1)
            largest = events.masked_fill(~real, -math.inf).cummax(dim=1).values
        else:
            count = real.sum(dim=1)
            total = (events * real).sum(dim=1)
            largest = events.masked_fill(~real, -math.inf).amax(dim=1)
        seen = count > 0  # an empty journey (or padding before any event) aggregates to 0
        mean = total / count.clamp(min=1)
        largest = torch.where(seen, largest, torch.zeros_like(largest))
        length = torch.log1p(count.to(events.dtype)) / self.log_max_len
        hidden = F.gelu(self.fc(torch.cat([mean, largest, length], dim=-1)))
        return self.out(self.dropout(hidden)).squeeze(-1)


class JourneyTransformer(nn.Module):
    """Journey -> conversion logit (and, if causal, a logit after every event)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d_model = config.d_model
        self.event_embedding = nn.Embedding(config.vocab_size, d_model, padding_idx=0)
        self.feature_embeddings = nn.ModuleList(
            nn.Embedding(size, d_model, padding_idx=0) for size in config.feature_vocab_sizes
        )
        self.time_embedding = nn.Embedding(config.n_time_buckets, d_model, padding_idx=0)
        self.visit_embedding: nn.Embedding | None = None
        if config.visit_bucket is not None:
            self.visit_embedding = nn.Embedding(config.n_time_buckets, d_model, padding_idx=0)
        self.continuous_projection: nn.Module | None = None
        if config.n_continuous and config.continuous_encoding == "periodic":
            self.continuous_projection = PeriodicInputs(config)
        elif config.n_continuous and config.continuous_encoding == "piecewise":
            self.continuous_projection = PiecewiseLinearInputs(config)
        elif config.n_continuous:
            self.continuous_projection = nn.Linear(config.n_continuous, d_model)
        n_positions = config.max_len + int(config.uses_cls)
        self.position_embedding: nn.Embedding | None = None
        if config.positional == "learned":
            self.position_embedding = nn.Embedding(n_positions, d_model)
        # Not persistent: it is a function of the config, so checkpoints need not carry it.
        self.register_buffer(
            "sinusoid",
            sinusoidal_table(n_positions, d_model) if config.positional == "sinusoidal" else None,
            persistent=False,
        )
        self.cls = nn.Parameter(torch.zeros(d_model)) if config.uses_cls else None
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        # Pre-norm leaves the residual stream un-normalised; post-norm blocks end normalised.
        self.ln_f = nn.LayerNorm(d_model) if config.norm == "pre" else nn.Identity()
        self.head = nn.Linear(d_model, 1)
        self.wide = WidePart(config) if config.wide else None
        self._init_weights()

    def _init_weights(self) -> None:
        for name, param in self.named_parameters():
            if "ln_" in name:
                continue  # LayerNorm: weight 1, bias 0 (PyTorch's default)
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif name == "continuous_projection.frequencies":
                nn.init.normal_(param, std=self.config.periodic_sigma)
            elif name == "continuous_projection.weight" and isinstance(
                self.continuous_projection, PiecewiseLinearInputs
            ):
                nn.init.zeros_(param)  # the bins start silent: the projection alone
            elif name == "continuous_projection.weight" and param.dim() == 3:
                # Each input's 2K periodic features to about unit scale, as an embedding;
                # the ReLU halves it, the sum over inputs adds it back.
                nn.init.normal_(param, std=1.0 / math.sqrt(param.size(1)))
            elif name in ("continuous_projection.weight", "continuous_projection.linear.weight"):
                # Inputs of about unit scale come out of about unit scale, like an
                # embedding: an equal voice in the sum from the first step.
                nn.init.normal_(param, std=1.0 / math.sqrt(self.config.n_continuous))
            elif "embedding" in name:
                # Unit scale, as nn.Embedding's default: content embeddings then match the
                # sinusoid's amplitude (Vaswani et al. instead scale d^-1/2 tables by sqrt(d)).
                nn.init.normal_(param, std=1.0)
            elif name == "wide.out.weight":
                # The wide logit starts at zero: training begins from the sequence alone.
                nn.init.zeros_(param)
            elif name.endswith("proj.weight"):
                # GPT-2: residual branches scaled down so the stream's variance does not
                # grow with depth.
                nn.init.normal_(param, std=INIT_STD / math.sqrt(2 * self.config.n_layers))
            else:  # other weight matrices and the CLS vector
                nn.init.normal_(param, std=INIT_STD)
        for embedding in self.input_embeddings():
            with torch.no_grad():
                embedding.weight[0].zero_()

    def input_embeddings(self) -> list[nn.Embedding]:
        """The per-event embedding tables whose outputs are summed into the input."""
        tables = [self.event_embedding, self.time_embedding, *self.feature_embeddings]
        return tables if self.visit_embedding is None else [*tables, self.visit_embedding]

    def visit_gaps(self, time_buckets: Tensor, mask: Tensor) -> Tensor:
        """[B, L]: the time bucket of the gap that opened each event's visit (0 on padding).

        A visit opens at the first event and at every gap of at least `visit_bucket`; each
        event takes the bucket at its visit's first event (earlier events only: causal-safe).
        """
        assert self.config.visit_bucket is not None
        positions = torch.arange(time_buckets.size(1), device=time_buckets.device)
        opens = (time_buckets >= self.config.visit_bucket) | (positions == 0)
        latest_open = torch.where(opens, positions, 0).cummax(dim=1).values
        return time_buckets.gather(1, latest_open) * mask

    def forward(
        self,
        tokens: Tensor,
        features: Tensor,
        time_buckets: Tensor,
        mask: Tensor,
        attention: AttentionMode | None = None,
        continuous: Tensor | None = None,
    ) -> ModelOutput:
        """tokens, time_buckets [B, L] long; features [B, F, L] long; mask [B, L] bool;
        continuous [B, C, L] float (models with `n_continuous`).

        Right padding is assumed: each journey's real events come first.
        """
        if attention not in (None, "pooled", "rollout"):
            raise ValueError(f"attention must be None, 'pooled' or 'rollout', not {attention!r}")
        if tokens.size(1) > self.config.max_len:
            raise ValueError(
                f"journeys of {tokens.size(1)} events exceed max_len {self.config.max_len}"
            )
        mask = mask.bool()
        lengths = mask.sum(dim=1)
        events = self.event_embeddings(tokens, features, time_buckets, mask, continuous)
        x, seq_mask = self._sequence(events, mask, lengths)
        attn_mask = self._attention_mask(seq_mask)

        rows, row_weights = self._pooled_queries(seq_mask, lengths)
        per_layer: list[Tensor] = []  # head-averaged weights, only when asked for
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            want_rows = rows if attention == "pooled" and i == last else None
            x, weights = block(x, attn_mask, want_rows, full=attention == "rollout")
            if weights is not None:
                per_layer.append(weights.mean(dim=1).float())
        h = self.ln_f(x)

        last_index = (lengths - 1).clamp(min=0)
        prefix_logits = None
        if self.config.causal:
            prefix_logits = self.head(h).squeeze(-1)
            logits = prefix_logits.gather(1, last_index[:, None]).squeeze(1)
        else:
            logits = self.head(self._pool(h, mask, last_index)).squeeze(-1)
        if self.wide is not None:
            wide = self.wide(events, mask, self.config.causal)
            if prefix_logits is not None:
                prefix_logits = prefix_logits + wide
                wide = wide.gather(1, last_index[:, None]).squeeze(1)
            logits = logits + wide

        exported = None
        if attention == "pooled":
            exported = (row_weights[..., None] * per_layer[0]).sum(dim=1)
        elif attention == "rollout":
            # The pooled query as a weighting of all positions, then its rollout row.
            query = torch.zeros_like(seq_mask, dtype=row_weights.dtype)
            query = query.scatter_add(1, rows, row_weights)
            exported = (query[:, None, :] @ attention_rollout(per_layer)).squeeze(1)
        if exported is not None:
            if self.cls is not None:
                exported = exported[:, 1:]
            exported = exported * mask
            exported = exported / exported.sum(dim=1, keepdim=True).clamp(min=1e-12)
        return ModelOutput(logits, prefix_logits, exported)

    def event_embeddings(
        self,
        tokens: Tensor,
        features: Tensor,
        time_buckets: Tensor,
        mask: Tensor,
        continuous: Tensor | None = None,
    ) -> Tensor:
        """[B, L, D]: the sum of each event's `input_modules` (no position, no CLS)."""
        x = self.event_embedding(tokens) + self.time_embedding(time_buckets)
        for i, embedding in enumerate(self.feature_embeddings):
            x = x + embedding(features[:, i])
        if self.visit_embedding is not None:
            x = x + self.visit_embedding(self.visit_gaps(time_buckets, mask))
        if self.continuous_projection is not None:
            if continuous is None:
                raise ValueError("this model reads continuous inputs per event: pass `continuous`")
            # Zero on padding, like the embeddings' padding rows (the bias would not be).
            projected = self.continuous_projection(continuous.transpose(1, 2).to(x.dtype))

            x = x + projected * mask[..., None]
        return x

    def input_modules(self) -> list[nn.Module]:
        """Every module whose output is summed into an event's input (integrated gradients
        scales them all): the embedding tables and the continuous projection."""
        extra = [self.continuous_projection] if self.continuous_projection is not None else []
        return [*self.input_embeddings(), *extra]

    def _sequence(self, x: Tensor, mask: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Summed embeddings [B, L, D] -> plus CLS and positions [B, L(+1), D], and the mask
        of that sequence."""
        if self.cls is not None:
            batch = x.size(0)
            x = torch.cat([self.cls.expand(batch, 1, -1), x], dim=1)
            mask = torch.cat([mask.new_ones(batch, 1), mask], dim=1)
        table = self.position_embedding.weight if self.position_embedding is not None else None
        table = self.sinusoid if table is None else table
        if table is not None:
            x = x + table[self._positions(lengths, x.size(1))]
        return self.embedding_dropout(x), mask

    def _positions(self, lengths: Tensor, length: int) -> Tensor:
        """Position ids [L] (from the start) or [B, L] (from the end; CLS keeps id 0).

        Counted from the end, the last event is position 0 (1 after a CLS token) in every
        journey: "among the last three events" is one embedding, and a journey cut to its
        most recent `max_events` keeps the ids its events had before the cut.
        """
        index = torch.arange(length, device=lengths.device)
        if self.config.position_origin == "start":
            return index
        shift = int(self.cls is not None)
        from_end = (lengths[:, None] - 1 + 2 * shift) - index  # CLS (index 0) -> len + shift
        from_end = from_end.clamp(min=shift)  # padding: any id, it is masked
        if self.cls is not None:
            from_end[:, 0] = 0
        return from_end

    def _attention_mask(self, seq_mask: Tensor) -> Tensor:
        """Bool mask for SDPA, True = may attend: [B, 1, 1, L], or [B, 1, L, L] if causal."""
        # Position 0 is real in every non-empty right-padded journey; letting every query
        # see it keeps an empty journey's softmax finite instead of NaN.
        keys = seq_mask.clone()
        keys[:, 0] = True
        attn_mask = keys[:, None, None, :]
        if self.config.causal:
            length = seq_mask.size(1)
            causal = torch.ones(length, length, dtype=torch.bool, device=seq_mask.device).tril()
            attn_mask = attn_mask & causal
        return attn_mask

    def _pool(self, h: Tensor, mask: Tensor, last_index: Tensor) -> Tensor:
        """[B, L, D] -> [B, D]: the CLS position, the mean of real events, or the last one."""
        if self.config.pooling == "cls":
            return h[:, 0]
        if self.config.pooling == "mean":
            real = mask[..., None].to(h.dtype)
            return (h * real).sum(dim=1) / real.sum(dim=1).clamp(min=1)
        return h.gather(1, last_index[:, None, None].expand(-1, 1, h.size(2))).squeeze(1)

    def _pooled_queries(self, seq_mask: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """The query rows whose attention describes the pooled representation.

        Returns rows [B, R] (positions in the sequence, CLS included) and their weights
        [B, R] summing to 1: the CLS row, every real row equally (mean pooling), or the last
        real event's row (last pooling and causal models).
        """
        batch = seq_mask.size(0)
        if self.config.uses_cls:
            rows = seq_mask.new_zeros(batch, 1, dtype=torch.long)
            return rows, torch.ones(batch, 1, device=seq_mask.device)
        if self.config.pooling == "mean" and not self.config.causal:
            length = seq_mask.size(1)
            rows = torch.arange(length, device=seq_mask.device).expand(batch, length)
            real = seq_mask.float()
            return rows, real / real.sum(dim=1, keepdim=True).clamp(min=1)
        rows = (lengths - 1).clamp(min=0)[:, None]
        return rows, torch.ones(batch, 1, device=seq_mask.device)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def attention_rollout(per_layer: list[Tensor]) -> Tensor:
    """Abnar & Zuidema (2020): head-averaged maps [B, L, L] per layer, first layer first.

    Each layer's map gets the identity added for the residual connection, rows are
    renormalised, and the maps are multiplied through the layers: row i of the result says
    how much of position i's final representation flows from each input position.
    """
    rollout: Tensor | None = None
    for weights in per_layer:
        eye = torch.eye(weights.size(-1), device=weights.device, dtype=weights.dtype)
        layer = weights + eye
        layer = layer / layer.sum(dim=-1, keepdim=True)
        rollout = layer if rollout is None else layer @ rollout
    assert rollout is not None, "the model has at least one layer"
    return rollout
