"""The embedder's bfloat16 passes (AGW_RETRIEVAL_EMBED_BF16), on the bundled model.

Where the CPU runs bfloat16 natively, every pass runs its matrix products in
bfloat16, the model's linear weights cast once at load; its vectors must stay
where fp32 puts them (ranking unchanged), a lone query's too. ``auto`` must
follow the CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from retrieval.embedder import Embedder, _packed_for_onednn, cast_linears_to_bf16, cpu_bf16_kind, runs_in_bf16
from retrieval.settings import RetrievalSettings

pytestmark = pytest.mark.integration

TEXTS = [
    "The gateway keeps long-lived mTLS channels to every backend.",
    "Refunds are issued within five business days of the return.",
    "vLLM's prefix cache reuses the KV blocks of a shared system prompt.",
    "Qdrant's hnsw_ef trades recall for search latency.",
    "An invoice lists the order, its taxes and the payment terms.",
    "Postgres stores each turn in one transaction, both messages or neither.",
    "Keepalive pings find a silent connection before a call does.",
    "The tenant's certificate names its SPIFFE identity.",
]
QUERY = "how long does a refund take?"


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


@pytest.fixture(scope="module")
async def embedders():
    fp32 = await Embedder.load(None, bf16="off")
    half = await Embedder.load(None, bf16="on")
    yield fp32, half
    await fp32.close()
    await half.close()


async def test_a_bf16_pass_keeps_fp32s_vectors_and_ranking(embedders):
    fp32, half = embedders
    assert not fp32.bf16 and half.bf16
    exact, approx = await fp32.embed(TEXTS), await half.embed(TEXTS)
    assert approx != exact, "the pass did not run in bfloat16"
    cosines = [_dot(a, b) for a, b in zip(exact, approx)]  # normalised vectors: the dot is the cosine
    assert min(cosines) >= 0.9999, cosines
    query = (await fp32.embed([QUERY]))[0]
    ranking = lambda vectors: sorted(range(len(TEXTS)), key=lambda i: -_dot(query, vectors[i]))  # noqa: E731
    assert ranking(approx) == ranking(exact)
    assert ranking(exact)[0] == 1  # the refund text: the model itself still answers


async def test_a_lone_query_runs_in_bf16_too(embedders):
    fp32, half = embedders
    exact, approx = (await fp32.embed([QUERY]))[0], await half.embed_query(QUERY)
    assert approx != exact, "the lone query did not run in bfloat16"
    assert _dot(exact, approx) >= 0.9999


def test_every_linear_layer_is_cast_once_and_nothing_else():
    """The weights are cast at load, not on every pass; the layer norms stay fp32."""
    model = torch.nn.ModuleDict({"first": torch.nn.Linear(4, 3), "norm": torch.nn.LayerNorm(3),
                                 "inner": torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))})
    first, second = model["first"].weight.detach().clone(), model["inner"][0].weight.detach().clone()
    bias = model["first"].bias.detach().clone()
    assert cast_linears_to_bf16(model) == 2
    cast_first, cast_second = model["first"], model["inner"][0]
    assert cast_first.weight.dtype == cast_first.bias.dtype == cast_second.weight.dtype == torch.bfloat16
    assert cast_second.bias is None
    assert model["norm"].weight.dtype == torch.float32
    x = torch.randn(5, 4)
    with torch.inference_mode():
        out = cast_second(cast_first(x))
        assert out.dtype == torch.bfloat16  # as under autocast: a linear's output stays bfloat16
        bf16 = torch.bfloat16
        expected = torch.nn.functional.linear(
            torch.nn.functional.linear(x.to(bf16), first.to(bf16), bias.to(bf16)), second.to(bf16))
    assert torch.equal(out, expected)


def test_packed_layers_compute_what_plain_bf16_layers_do():
    """Packing for oneDNN changes where the weights lie, not the products: on a CPU that runs bfloat16
    natively every layer packs; elsewhere a layer that cannot pack runs ``F.linear`` (same outputs either way)."""
    torch.manual_seed(3)
    source = torch.nn.Sequential(torch.nn.Linear(384, 1536), torch.nn.GELU(), torch.nn.Linear(1536, 384, bias=False))
    plain, packed = copy.deepcopy(source), copy.deepcopy(source)
    cast_linears_to_bf16(plain)
    cast_linears_to_bf16(packed, prepack=True)
    assert plain[0].packed is None and plain[2].packed is None
    if cpu_bf16_kind() != "emulated":
        assert packed[0].packed is not None and packed[2].packed is not None
    x = torch.randn(2, 9, 384)  # a pass of two 9-token texts, as the transformer's layers see it
    with torch.inference_mode():
        expected, out = plain(x), packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 9, 384)
    assert torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_a_weight_onednn_cannot_serve_is_not_packed():
    """The check behind packing: a weight the packed product does not reproduce falls back (None)."""
    assert _packed_for_onednn(torch.randn(8, 16)) is None  # fp32: the bfloat16 probe cannot use it


async def test_the_bundled_models_layers_are_packed_where_bf16_is_native(embedders):
    _, half = embedders
    native = cpu_bf16_kind() != "emulated"
    assert half.packed_layers == (37 if native else 0)  # six layers of six linears, and the pooler's
    if not native:
        return
    # Through the modules on both sides: the fused pass packs stacked weights of its own.
    packed_modules = await Embedder.load(None, bf16="on", fused=False)
    unpacked = await Embedder.load(None, bf16="on", fused=False)
    try:
        for module in unpacked._model.modules():
            if getattr(module, "packed", None) is not None:
                module.packed = None
        assert unpacked.packed_layers == 0
        packed, plain = await packed_modules.embed(TEXTS + [QUERY]), await unpacked.embed(TEXTS + [QUERY])
        assert min(_dot(a, b) for a, b in zip(packed, plain)) >= 0.99999
    finally:
        await packed_modules.close()
        await unpacked.close()


@pytest.mark.parametrize(("mode", "cpu", "bf16"), [
    ("auto", "amx", True),
    ("auto", "avx512_bf16", True),
    ("auto", "emulated", False),
    ("on", "amx", True),
    ("on", "avx512_bf16", True),
    ("on", "emulated", True),
    ("off", "amx", False),
    ("off", "avx512_bf16", False),
])
def test_bf16_follows_the_mode_and_the_cpu(mode, cpu, bf16):
    assert runs_in_bf16(mode, cpu) is bf16


async def test_auto_follows_this_cpu_and_bad_values_are_refused(monkeypatch):
    kind = cpu_bf16_kind()
    assert kind in ("amx", "avx512_bf16", "emulated")
    auto = await Embedder.load(None, bf16="auto")
    try:
        assert auto.bf16 is runs_in_bf16("auto", kind)
    finally:
        await auto.close()
    with pytest.raises(ValueError, match="auto, on or off"):
        runs_in_bf16("yes", kind)
    with pytest.raises(ValueError, match="unknown CPU bfloat16 kind"):
        runs_in_bf16("auto", "avx2")
    monkeypatch.setenv("AGW_RETRIEVAL_EMBED_BF16", "fast")
    with pytest.raises(ValidationError, match="embed_bf16"):
        RetrievalSettings()
    monkeypatch.setenv("AGW_RETRIEVAL_EMBED_BF16", "off")
    assert RetrievalSettings().embed_bf16 == "off"
