"""GPT-2-shaped user cases of real width (Hugging Face GPT2Config, random weights), written with the
public Case API, for the verify-cost bench (`python -m harness bench --only verify-cost`) and issue 31:
`d128` (0.9M parameters), `d256` (d = 256, 4 layers, vocabulary 8192: 5.3M), `d384` (d = 384, 6 layers,
vocabulary 16000: 16.8M), `small` (GPT-2 small: d = 768, 12 layers, vocabulary 50257: 124M). Split data,
2 AdamW steps, a global batch of 8 sequences of 64 tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec

SEQ, BATCH = 64, 8
SIZES = {"d128": (128, 2, 4096), "d256": (256, 4, 8192), "d384": (384, 6, 16000), "small": (768, 12, 50257)}


def _model(d: int, layers: int, vocab: int):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=d, n_layer=layers, n_head=max(1, d // 64),
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _case(name: str) -> Case:
    d, layers, vocab = SIZES[name]

    def batch(seed, step, global_batch):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        ids = torch.randint(0, vocab, (global_batch, SEQ + 1), generator=g)
        return {"input_ids": ids[:, :-1], "use_cache": False}, ids[:, 1:]

    def loss(outputs, targets):
        logits = outputs.logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return Case(name=f"gpt2_{name}", description=f"GPT-2 d={d}, {layers} layers, vocabulary {vocab}",
                build_model=lambda: _model(d, layers, vocab), wrap=lambda fqn, m: type(m).__name__ == "GPT2Block",
                make_batch=batch, loss_fn=loss, optimizers=(OptimizerSpec("adamw", lr=1e-4, weight_decay=0.01),),
                steps=2, global_batch=BATCH, data_modes=("split",), world_sizes=(1, 2, 4), requires=("transformers",))


def d128() -> Case:
    return _case("d128")


def d256() -> Case:
    return _case("d256")


def d384() -> Case:
    return _case("d384")


def small() -> Case:
    return _case("small")
