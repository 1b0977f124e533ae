"""Real architectures of the field, built from Hugging Face `transformers` configs with random
weights (nothing is downloaded), used as they come: keyword inputs in, a CausalLMOutput out. GPT-2 (learned positions, input and output embedding tied),
Llama (RoPE, RMSNorm, grouped-query attention, SwiGLU) and Mixtral (a router sending each token to
2 of 4 experts, so some experts get no token of some ranks' batches). Sizes are small enough for
8 ranks on 2 CPU cores; the shapes are the real modules'.

`transformers` is an optional dependency (`pip install -e .[models]`); the cases exist without
it and say how to install it when a model is built.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.data import token_batch

# Heads of 8, 2 layers, a vocabulary and a sequence length of 16 and 32: every parameter kind of
# the architecture, and flat parameters that need padding at W = 8.
VOCAB, SEQ = 61, 16
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=32, num_attention_heads=4)
_TOKENS = token_batch(VOCAB, SEQ)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("this case builds a Hugging Face model: pip install -e '.[models]' "
                          "(transformers, pinned in pyproject.toml)") from None
    transformers.logging.set_verbosity_error()  # config notes about unused token ids
    return transformers


def gpt2() -> nn.Module:
    t = _transformers()
    config = t.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return _eager(t.GPT2LMHeadModel, config)


def llama() -> nn.Module:
    t = _transformers()
    config = t.LlamaConfig(**COMMON, intermediate_size=48, num_key_value_heads=2, max_position_embeddings=SEQ,
                           attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return _eager(t.LlamaForCausalLM, config)


def mixtral() -> nn.Module:
    t = _transformers()
    config = t.MixtralConfig(**COMMON, intermediate_size=24, num_key_value_heads=2, max_position_embeddings=SEQ,
                             num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.0,
                             router_jitter_noise=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return _eager(t.MixtralForCausalLM, config)


def _eager(model_class, config) -> nn.Module:
    """No dropout (the configs set every dropout to 0), eager attention: the same kernels on the
    same shapes give the same bits in every rank and in the replay."""
    config._attn_implementation = "eager"
    return model_class(config)


# The decoder blocks, chosen by class name: a wrap policy, because the classes live in the optional
# transformers package, which the catalog does not import.
_BLOCK_CLASSES = ("GPT2Block", "LlamaDecoderLayer", "MixtralDecoderLayer")


def decoder_blocks(fqn: str, module: nn.Module) -> bool:
    return type(module).__name__ in _BLOCK_CLASSES


def causal_lm_batch(seed: int, step: int, global_batch: int):
    """({'input_ids': (B, T), 'use_cache': False}, next-token targets (B, T)): the inputs reach the
    model as keyword arguments; use_cache, not a tensor, reaches every rank unchanged."""
    input_ids, targets = _TOKENS(seed, step, global_batch)
    return {"input_ids": input_ids, "use_cache": False}, targets


def causal_lm_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of a Hugging Face CausalLMOutput's logits (B, T, V)."""
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class SmallConvNet(nn.Module):
    """Conv -> BatchNorm -> ReLU twice, pooled, a linear head: BatchNorm's batch statistics and
    running buffers, the case that decides what equivalence means for them."""

    def __init__(self, channels: int = 6, classes: int = 5, sync: bool = False) -> None:
        super().__init__()
        norm = nn.SyncBatchNorm if sync else nn.BatchNorm2d
        self.block1 = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), norm(channels), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), norm(channels), nn.ReLU())
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes)
        return self.head(self.block2(self.block1(images)).mean(dim=(2, 3)))
