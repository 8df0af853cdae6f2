"""A BERT sentence encoder with mean pooling, run as one function over the model's own weights.

all-MiniLM-L6-v2 (the default embedder) is such a model: a 6-layer BERT, mean
pooling over the tokens, normalisation. Called through its modules, a pass
over one query runs Transformers' and sentence-transformers' plumbing
(argument handling, mask building, attention dispatch, output objects)
around 40 small matrix products, and on a CPU that plumbing is a large part
of a lone query's pass: 1.5-2 ms of 5.5 on a Zen 4 core in bfloat16
(docs/benchmarks.md, "The embedder's passes fused"). Here the same
arithmetic runs as one loop over the layers, and each layer's query, key and
value projections are one product over their weights stacked (one read of
the activations, one call instead of three).

Only a model of exactly this shape is taken (:meth:`FusedBertEncoder.of`
answers None otherwise), and the embedder checks the result against the
model's own forward pass at load before using it (``retrieval.embedder``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Builds one linear layer computing the given ones side by side (their weights stacked), of their own kind.
StackLinears = Callable[[list[Any]], Any]


class FusedBertEncoder:
    """The mean-pooled token vectors of a BERT sentence-transformers model, computed in one function.

    Build it with :meth:`of`. Calling it with the model's ``preprocess``
    features gives one fp32 row per text, not yet normalised: what the
    model's pooling module gives.
    """

    def __init__(self, bert: Any, stack: StackLinears) -> None:
        self._embeddings = bert.embeddings
        self._heads = bert.config.num_attention_heads
        self._layers = []
        for layer in bert.encoder.layer:
            attention = layer.attention
            projections = stack([attention.self.query, attention.self.key, attention.self.value])
            self._layers.append((projections, attention.output.dense, attention.output.LayerNorm,
                                 layer.intermediate.dense, layer.intermediate.intermediate_act_fn,
                                 layer.output.dense, layer.output.LayerNorm))

    @classmethod
    def of(cls, model: Any, stack: StackLinears) -> FusedBertEncoder | None:
        """The encoder for ``model``, or None where it is not an encoder-only BERT with absolute positions,
        plain self-attention and mean pooling over every token, followed at most by normalisation.

        ``stack`` builds each layer's query, key and value projections as one layer (the embedder's
        ``stacked_linear``, which knows its bfloat16 layers)."""
        modules = list(model)
        if len(modules) not in (2, 3):
            return None
        bert = getattr(modules[0], "auto_model", None)
        pooling = modules[1]
        config = getattr(bert, "config", None)
        if (config is None or config.model_type != "bert" or config.is_decoder
                or getattr(config, "position_embedding_type", "absolute") != "absolute"
                or getattr(pooling, "pooling_mode", None) != "mean" or not getattr(pooling, "include_prompt", False)
                or (len(modules) == 3 and type(modules[2]).__name__ != "Normalize")):
            return None
        projections = [getattr(layer.attention.self, name) for layer in bert.encoder.layer
                       for name in ("query", "key", "value")]
        if any(getattr(p, "bias", None) is None for p in projections):  # stacked with their biases, or not at all
            return None
        return cls(bert, stack)

    def __call__(self, features: dict) -> Any:
        import torch.nn.functional as F

        ids, mask = features["input_ids"], features["attention_mask"]
        texts, length = ids.shape
        embeddings = self._embeddings
        token_types = features.get("token_type_ids")
        x = (embeddings.word_embeddings(ids) + embeddings.position_embeddings.weight[:length]
             + (embeddings.token_type_embeddings(token_types) if token_types is not None
                else embeddings.token_type_embeddings.weight[0]))
        x = embeddings.LayerNorm(x)
        # A lone text (or texts of one length) has no padding to keep out of the attention.
        keys = None if bool(mask.all()) else mask[:, None, None, :].bool()
        for projections, attention_out, attention_norm, intermediate, activation, out, out_norm in self._layers:
            query, key, value = projections(x).view(texts, length, 3, self._heads, -1).permute(2, 0, 3, 1, 4)
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=keys)
            attended = attention_norm(attention_out(context.transpose(1, 2).reshape(texts, length, -1)) + x)
            x = out_norm(out(activation(intermediate(attended))) + attended)
        weights = mask.unsqueeze(-1).to(x.dtype)
        return ((x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)).float()
