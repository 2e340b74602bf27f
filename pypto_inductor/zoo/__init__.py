"""The real-model zoo: `transformers` models from tiny configs, random weights, no hub access.

Shared by tests/test_real_models.py, tests/test_distributed.py, the coverage table
(``python -m pypto_inductor models``) and benchmarks. Every model is built from a
config (never downloaded) with dropout 0, so compiled and eager runs are
comparable; ``batch(name, seed)`` gives a fresh random batch of keyword
arguments, labels included, so ``model(**batch)["loss"]`` is a training loss.

The ResNet entry is a small hand-built ResNet (BasicBlocks with BatchNorm): torchvision
does not import beside the pinned CPU torch 2.13.0 (its 0.28.0 wheel is a CUDA build
needing libc10_cuda.so; 0.29.x requires torch>=2.14).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..report import collect

# The zoo never downloads: configs only, and the hub stays off even if asked.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH, SEQ, VOCAB, WIDTH, LAYERS, HEADS, FFN = 2, 16, 256, 64, 2, 4, 128
IMAGE = 32
CLASSES = 10
TARGET_LEN = 8  # decoder length of the encoder-decoder models
# config ids of the special tokens of the text models (pad, bos, eos)
PAD, BOS, EOS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    kind: str  # "causal_lm", "encoder" (text classifier), "seq2seq", "vision"
    make: Callable[[], nn.Module]  # builds the model from its config (seeded by build())
    make_batch: Callable[[torch.Generator], dict]  # keyword arguments, labels included

    @property
    def causal_lm(self) -> bool:
        return self.kind == "causal_lm"


def _tokens(gen: torch.Generator, *shape) -> torch.Tensor:
    # ids above the special tokens, so no accidental padding or end of sequence
    return torch.randint(EOS + 1, VOCAB, shape, generator=gen)


def _causal_lm_batch(gen: torch.Generator) -> dict:
    ids = _tokens(gen, BATCH, SEQ)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
            "use_cache": False}


def _padding_mask(gen: torch.Generator) -> torch.Tensor:
    """1 for tokens, 0 for padding: the second sequence ends with a random number of pads."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    pads = int(torch.randint(3, SEQ // 2, (), generator=gen))
    mask[1, SEQ - pads:] = 0
    return mask


def _classifier_batch(gen: torch.Generator, token_types: bool) -> dict:
    ids = _tokens(gen, BATCH, SEQ)
    mask = _padding_mask(gen)
    batch = {"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask,
             "labels": torch.randint(0, 3, (BATCH,), generator=gen)}
    if token_types:
        batch["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ).clone()
    return batch


def _t5_batch(gen: torch.Generator) -> dict:
    mask = _padding_mask(gen)
    return {"input_ids": _tokens(gen, BATCH, SEQ).masked_fill(mask == 0, PAD),
            "attention_mask": mask, "labels": _tokens(gen, BATCH, TARGET_LEN), "use_cache": False}


def _image_batch(gen: torch.Generator) -> dict:
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=gen)}


def _whisper_batch(gen: torch.Generator) -> dict:
    # Whisper's encoder takes exactly 2 * max_source_positions frames
    return {"input_features": torch.randn(BATCH, 16, 2 * SEQ, generator=gen),
            "labels": _tokens(gen, BATCH, TARGET_LEN), "use_cache": False}


_TEXT = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
_DECODER = dict(hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=64, **_TEXT)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
                                      n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, **_TEXT))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    # GQA: two key/value heads shared by four query heads
    return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **_DECODER))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **_DECODER))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    # a window shorter than the sequence, so the sliding-window mask matters
    return MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=SEQ // 2,
                                            **_DECODER))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(num_key_value_heads=2, original_max_position_embeddings=64,
                                      **_DECODER))


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=PAD))


def _distilbert():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    return DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=VOCAB, dim=WIDTH, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, qa_dropout=0.0,
        seq_classif_dropout=0.0, num_labels=3, pad_token_id=PAD))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=FFN, num_layers=LAYERS, num_decoder_layers=LAYERS,
        num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=PAD, **_TEXT))


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=WIDTH,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=CLASSES))


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(WhisperConfig(
        num_mel_bins=16, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN, max_source_positions=SEQ, max_target_positions=32,
        decoder_start_token_id=BOS, suppress_tokens=None, begin_suppress_tokens=None, **_TEXT))


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convs with BatchNorm and a (projected when needed) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-18's structure at toy size (stem, two stages of two BasicBlocks, pool, fc).

    Returns ``{"logits", "loss"}`` like a transformers classifier.
    """

    def __init__(self, widths=(16, 32), classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], widths[0]
        for i, width in enumerate(widths):
            blocks += [BasicBlock(cin, width, 1 if i == 0 else 2), BasicBlock(width, width, 1)]
            cin = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, pixel_values, labels=None):
        x = self.blocks(self.stem(pixel_values))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


ZOO: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("gpt2", "causal_lm", _gpt2, _causal_lm_batch),
    ZooModel("llama", "causal_lm", _llama, _causal_lm_batch),
    ZooModel("qwen2", "causal_lm", _qwen2, _causal_lm_batch),
    ZooModel("mistral", "causal_lm", _mistral, _causal_lm_batch),
    ZooModel("phi3", "causal_lm", _phi3, _causal_lm_batch),
    ZooModel("bert", "encoder", _bert, lambda g: _classifier_batch(g, token_types=True)),
    ZooModel("distilbert", "encoder", _distilbert, lambda g: _classifier_batch(g, False)),
    ZooModel("t5", "seq2seq", _t5, _t5_batch),
    ZooModel("vit", "vision", _vit, _image_batch),
    ZooModel("whisper", "seq2seq", _whisper, _whisper_batch),
    ZooModel("resnet", "vision", ResNet, _image_batch),
]}
CAUSAL_LMS = [m.name for m in ZOO.values() if m.causal_lm]


def build(name: str, seed: int = 0) -> nn.Module:
    """The zoo model ``name`` with seeded random weights, in eval mode."""
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; choose from {sorted(ZOO)}")
    torch.manual_seed(seed)
    return ZOO[name].make().eval()


def batch(name: str, seed: int = 0) -> dict:
    """A fresh random batch of keyword arguments for ``name`` (labels included)."""
    return ZOO[name].make_batch(torch.Generator().manual_seed(seed))


def generate(model: nn.Module, input_ids: torch.Tensor, backend: str, dynamic: bool | None = None,
             options: dict | None = None, new_tokens: int = 8):
    """Greedy generation with ``model.forward`` compiled: (tokens, graphs compiled, reports).

    The count covers first compiles, graph breaks and recompiles; a compile that restarted
    Dynamo's analysis (AOTAutograd's TensorifyScalarRestartAnalysis) is not one.
    ``reports`` are the GraphReports of the pypto graphs compiled. ``options`` go to
    backend="pypto".
    """
    from torch._dynamo import lookup_backend

    compiled_graphs = 0
    inner = lookup_backend(backend)

    def counting_backend(gm, example_inputs):
        nonlocal compiled_graphs
        compiled = (inner(gm, example_inputs, options=options) if options
                    else inner(gm, example_inputs))
        compiled_graphs += 1
        return compiled

    torch._dynamo.reset()
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend=counting_backend, dynamic=dynamic)
    try:
        with torch.no_grad(), collect() as reports:
            tokens = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False)
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
    return tokens, compiled_graphs, reports


def compile_problems(reports) -> list[str]:
    """What kept compiled graphs from running as planned kernels, one line each.

    ``reports``: GraphReports (from ``report.collect()``). A graph that runs eagerly as a
    whole, or a kernel that failed to build, is a problem; extern ops are not.
    """
    from ..report import FusionReport

    problems = []
    for g in FusionReport(list(reports)).to_dict()["graphs"]:
        if g.get("eager_reason"):
            problems.append(f"graph {g['name']} runs eagerly: {g['eager_reason']}")
        for tile in g["fusion_tiles"]:
            if tile["kernel_fallback"]:
                problems.append(f"kernel {tile['name']} failed to build: {tile['kernel_fallback']}")
    return problems


def output_tensors(output) -> dict[str, torch.Tensor]:
    """The tensors of a model's output by name (logits, loss, encoder states, ...)."""
    items = output.items() if hasattr(output, "items") else enumerate(output)
    return {str(k): v for k, v in items if isinstance(v, torch.Tensor)}


__all__ = ["CAUSAL_LMS", "ZOO", "ZooModel", "ResNet", "batch", "build", "compile_problems",
           "generate", "output_tensors"]
