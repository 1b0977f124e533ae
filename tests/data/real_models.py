"""Real model shapes for the honest-verdict runs of issue 30, written with the public Case API
(`--cases tests/data/real_models.py:<factory>`): an RMSNorm/RoPE decoder with its token embedding
tied to the output head (Hugging Face Llama, tie_word_embeddings=True) and an encoder of
nn.MultiheadAttention layers (torch's own nn.TransformerEncoderLayer). Each factory has seeded
twins `<name>_s0` ... `<name>_s4` (initial weights and data drawn from the seed) for the honest
margin distribution in docs/error_model.md; the catalog's t5 and qwen2 cases get theirs here too."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec, get_case

VOCAB, SEQ, WIDTH, CLASSES = 61, 12, 36, 5
OPTIMIZERS = (OptimizerSpec("sgd", lr=0.05, momentum=0.9), OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01))


def _rope_tied_lm(seed: int) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      attention_dropout=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def _tokens(seed: int, step: int, batch: int):
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return {"input_ids": ids[:, :-1], "use_cache": False}, ids[:, 1:]


def _lm_loss(outputs, targets):
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class MHAEncoder(nn.Module):
    """Token embedding, two nn.TransformerEncoderLayer (nn.MultiheadAttention, pre-norm), a mean-pooled
    classifier: the attention's packed in_proj uses its input three times (q, k, v) beside the residual."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(WIDTH, 4, 40, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


def _classes(seed: int, step: int, batch: int):
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return {"input_ids": torch.randint(0, VOCAB, (batch, SEQ), generator=g)}, torch.randint(0, CLASSES, (batch,), generator=g)


def rope_tied_lm(seed: int = 0) -> Case:
    return Case(name=f"rope_tied_lm_s{seed}", description="Llama (RMSNorm, RoPE, GQA) with tied embeddings",
                build_model=lambda: _rope_tied_lm(seed),
                wrap=lambda fqn, m: type(m).__name__ == "LlamaDecoderLayer", make_batch=_tokens, loss_fn=_lm_loss,
                optimizers=OPTIMIZERS, seed=seed, world_sizes=(1, 2, 4), tags=("architecture",),
                requires=("transformers",))


def mha_encoder(seed: int = 0) -> Case:
    return Case(name=f"mha_encoder_s{seed}", description="nn.MultiheadAttention encoder, classifier",
                build_model=lambda: MHAEncoder(seed), wrap=(nn.TransformerEncoderLayer,), make_batch=_classes,
                loss_fn=F.cross_entropy, optimizers=OPTIMIZERS, seed=seed, world_sizes=(1, 2, 4),
                tags=("architecture",))


def _reseeded(name: str, seed: int) -> Case:
    """A catalog case with its data drawn from `seed` (its weights stay the catalog's)."""
    return dataclasses.replace(get_case(name), name=f"{name}_s{seed}", seed=seed)


for _seed in range(5):
    globals()[f"rope_tied_lm_s{_seed}"] = lambda s=_seed: rope_tied_lm(s)
    globals()[f"mha_encoder_s{_seed}"] = lambda s=_seed: mha_encoder(s)
    globals()[f"t5_s{_seed}"] = lambda s=_seed: _reseeded("t5", s)
    globals()[f"qwen2_s{_seed}"] = lambda s=_seed: _reseeded("qwen2", s)
