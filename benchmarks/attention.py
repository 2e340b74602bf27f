"""Attention written op by op: eager, Inductor, pypto with the chain unfused
(``fuse_attention=False``, the state before lowering/attention.py) and pypto with the
chain rewritten into one SDPA call, interleaved in one process; medians and ratios.

    python -m benchmarks.attention [--threads 2] [--rounds 5] [--repeats 20]
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import interleaved_medians, md_table, parse_timing, timing_parser


def bert_attention(q, k, v, mask):
    s = torch.matmul(q, k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    p = F.dropout(F.softmax(s + mask, dim=-1), p=0.0, training=False)
    return torch.matmul(p, v).transpose(1, 2).contiguous()


def t5_attention(q, k, v, bias):
    s = torch.matmul(q, k.transpose(3, 2)) + bias
    return torch.matmul(F.softmax(s.float(), dim=-1).type_as(s), v)


def llama_attention(q, k, v, mask):
    b, kv, s_, d = k.shape
    n = q.shape[1] // kv
    k = k[:, :, None].expand(b, kv, n, s_, d).reshape(b, kv * n, s_, d)
    v = v[:, :, None].expand(b, kv, n, s_, d).reshape(b, kv * n, s_, d)
    s = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5 + mask
    return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _cases(batch, heads, seq, dim):
    g = torch.Generator().manual_seed(0)

    def qkv(kv_heads=heads):
        return (torch.randn(batch, heads, seq, dim, generator=g),
                torch.randn(batch, kv_heads, seq, dim, generator=g),
                torch.randn(batch, kv_heads, seq, dim, generator=g))

    pad = torch.zeros(batch, 1, 1, seq)
    pad[1:, ..., seq - seq // 4:] = torch.finfo(torch.float32).min
    causal = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
    return [
        ("bert (padding mask)", bert_attention, (*qkv(), pad)),
        ("t5 (no scale, bias)", t5_attention, (*qkv(), torch.randn(1, heads, seq, seq, generator=g))),
        ("llama (GQA, causal)", llama_attention, (*qkv(heads // 2), causal)),
    ]


def _bert_model(seq):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=1024, max_position_embeddings=seq,
                                 attn_implementation="eager")).eval()
    ids = torch.randint(3, 1000, (8, seq))
    mask = torch.ones_like(ids)
    mask[1, seq - seq // 4:] = 0
    return model, (ids, mask)


def run(threads: int, rounds: int, repeats: int, train: bool) -> list[list[str]]:
    torch.set_num_threads(threads)
    cases = _cases(8, 4, 128, 64)
    from pypto_inductor import models

    torch.manual_seed(0)
    block = models.TransformerBlock(256, 4, 1024).eval()  # the suite's transformer_block
    llama = models.LlamaBlock(256, 4, 688).eval()  # and llama_block
    cases.append(("models.TransformerBlock 4x128x256", block, (torch.randn(4, 128, 256),)))
    cases.append(("models.LlamaBlock 4x128x256", llama, (torch.randn(4, 128, 256),)))
    try:
        model, inputs = _bert_model(128)
        cases.append(("BertModel eager attention, 8x128", lambda *a: model(*a)[0], inputs))
    except ImportError:
        pass
    rows = []
    for name, fn, inputs in cases:
        variants = {
            "eager": fn,
            "inductor": torch.compile(fn, backend="inductor"),
            "pypto unfused": torch.compile(fn, backend="pypto",
                                           options={"fuse_attention": False}),
            "pypto": torch.compile(fn, backend="pypto"),
        }
        args = list(inputs)
        if train:
            args = [a.clone().requires_grad_(i < 3 and a.is_floating_point())
                    for i, a in enumerate(args)]

        def call(f):
            out = f(*args)
            if train:
                out.sum().backward()
            return out

        ctx = torch.no_grad() if not train else torch.enable_grad()
        with ctx:
            ref = call(variants["eager"])
            for label, f in variants.items():  # compile, and check the result
                torch.testing.assert_close(call(f), ref, rtol=1e-4, atol=1e-4)
            med = interleaved_medians(variants, call, rounds, repeats)
        rows.append([name + (" fwd+bwd" if train else "")]
                    + [f"{med[v] / 1000:.2f}" for v in variants]
                    + [f"{med['eager'] / med['pypto unfused']:.2f}x",
                       f"{med['eager'] / med['pypto']:.2f}x",
                       f"{med['inductor'] / med['pypto']:.2f}x"])
    return rows


def main(argv=None) -> int:
    p = timing_parser(__doc__, threads=2, cpu_time=False)
    p.add_argument("--train", action="store_true", help="forward + backward")
    a = parse_timing(p, argv)
    header = ["case", "eager ms", "inductor ms", "pypto unfused ms", "pypto ms",
              "unfused vs eager", "pypto vs eager", "pypto vs inductor"]
    rows = run(a.threads, a.rounds, a.repeats, a.train)
    print("\n".join(md_table(header, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
