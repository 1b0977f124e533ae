"""Real architectures of the field, built from Hugging Face `transformers` configs with random
weights (nothing is downloaded), used as they come: keyword inputs in, a ModelOutput out.

Decoders: GPT-2 (learned positions, input and output embedding tied), Llama (RoPE, RMSNorm,
grouped-query attention, SwiGLU), Mixtral (a router sending each token to 2 of 4 experts, so some
experts get no token of some ranks' batches) and Qwen2 (grouped-query attention with q/k/v biases,
tied embeddings). T5 (encoder-decoder: relative position bias computed in the first block and
passed on, cross attention, the model's own loss from `labels`), BERT (a sequence classifier on
padded samples with an attention mask) and ViT (image patches, a class token). Sizes are small
enough for 8 ranks on 2 CPU cores; the shapes are the real modules'.

`transformers` is an optional dependency (`pip install -e .[models]`); the cases exist without
it and say how to install it when a model is built. `UnusedHeadNet` is plain torch: a parameter
the loss never reaches in a unit with parameters it does.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.data import image_batch, padded_sequence_batch, token_batch

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


# The models added for issue 30 use a width of 36: every unit's last parameter is a norm or a bias
# of 36 (or the classifier's of 3 or 5) elements, so each flat parameter, its slots aligned to 64,
# ends 4 (or 3, 5) past a multiple of 8 and needs tail padding at W = 8.
WIDE = 36


def qwen2() -> nn.Module:
    t = _transformers()
    config = t.Qwen2Config(vocab_size=VOCAB, hidden_size=WIDE, intermediate_size=40, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=SEQ,
                           attention_dropout=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return _eager(t.Qwen2ForCausalLM, config)


T5_TARGET_LEN = 8


def t5() -> nn.Module:
    t = _transformers()
    # tie_word_embeddings: one `shared` embedding for the encoder, the decoder and the output head.
    config = t.T5Config(vocab_size=VOCAB, d_model=WIDE, d_kv=9, d_ff=40, num_layers=2, num_decoder_layers=2,
                        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=SEQ,
                        dropout_rate=0.0, feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=0,
                        eos_token_id=1, decoder_start_token_id=0)
    return _eager(t.T5ForConditionalGeneration, config)


BERT_CLASSES = 3


def bert() -> nn.Module:
    t = _transformers()
    config = t.BertConfig(vocab_size=VOCAB, hidden_size=WIDE, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          classifier_dropout=0.0, max_position_embeddings=SEQ, num_labels=BERT_CLASSES,
                          pad_token_id=0)
    return _eager(t.BertForSequenceClassification, config)


VIT_CHANNELS, VIT_IMAGE, VIT_CLASSES = 3, 8, 5


def vit() -> nn.Module:
    t = _transformers()
    config = t.ViTConfig(hidden_size=WIDE, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, image_size=VIT_IMAGE,
                         patch_size=4, num_channels=VIT_CHANNELS, num_labels=VIT_CLASSES)
    return _eager(t.ViTForImageClassification, config)


def _eager(model_class, config) -> nn.Module:
    """No dropout (the configs set every dropout to 0), eager attention: the same kernels on the
    same shapes give the same bits in every rank and in the replay."""
    config._attn_implementation = "eager"
    return model_class(config)


# The blocks, chosen by class name: wrap policies, because the classes live in the optional
# transformers package, which the catalog does not import.
_BLOCK_CLASSES = ("GPT2Block", "LlamaDecoderLayer", "MixtralDecoderLayer", "Qwen2DecoderLayer")
# T5Block: the encoder's and the decoder's (the decoder's with cross attention).
_LAYER_CLASSES = ("T5Block", "BertLayer", "ViTLayer")


def decoder_blocks(fqn: str, module: nn.Module) -> bool:
    return type(module).__name__ in _BLOCK_CLASSES


def layer_blocks(fqn: str, module: nn.Module) -> bool:
    """The transformer layers of T5 (encoder and decoder), BERT and ViT."""
    return type(module).__name__ in _LAYER_CLASSES


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


def t5_batch(seed: int, step: int, global_batch: int):
    """({'input_ids': (B, T), 'labels': (B, T5_TARGET_LEN), 'use_cache': False}, the labels): the
    task is to write the first T5_TARGET_LEN tokens backwards. The model shifts the labels right
    into its decoder inputs and computes its own loss from them (`model_loss`); no label is -100,
    so every sample has the same number of loss terms and split data stays the global mean."""
    input_ids, _ = _TOKENS(seed, step, global_batch)
    labels = input_ids[:, :T5_TARGET_LEN].flip(1).contiguous()
    return {"input_ids": input_ids, "labels": labels, "use_cache": False}, labels


def model_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """The loss the model computed from the `labels` among its inputs (the targets repeat them)."""
    return outputs.loss


# Each sample keeps between 4 and 16 of its 16 tokens, the rest padded (id 0, mask 0), so most
# samples of a batch carry padding of their own length. The loss is a mean over samples
# (`classification_loss`), never over a batch's unmasked tokens, whose count would make a sample's
# weight depend on the others in its batch (and so on how the batch is split).
padded_classification_batch = padded_sequence_batch(VOCAB, SEQ, SEQ // 4, BERT_CLASSES)


_IMAGES = image_batch(VIT_CHANNELS, VIT_IMAGE, VIT_CLASSES)


def image_classification_batch(seed: int, step: int, global_batch: int):
    """({'pixel_values': (B, C, H, W)}, class labels (B,))."""
    images, labels = _IMAGES(seed, step, global_batch)
    return {"pixel_values": images}, labels


def classification_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the samples of a ModelOutput's logits (B, classes)."""
    return F.cross_entropy(outputs.logits, targets)


class HeadedBlock(nn.Module):
    """A tanh layer that also holds an auxiliary head (as one used only at evaluation): training
    never calls it, so its parameters get no gradient while the layer's beside them do."""

    def __init__(self, in_features: int, out_features: int, aux_classes: int, aux_first: bool) -> None:
        super().__init__()
        if aux_first:  # the unused parameters first in the unit's flat parameter, or after the used ones
            self.aux_head = nn.Linear(out_features, aux_classes)
            self.fc = nn.Linear(in_features, out_features)
        else:
            self.fc = nn.Linear(in_features, out_features)
            self.aux_head = nn.Linear(out_features, aux_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in) -> (B, out)
        return torch.tanh(self.fc(x))


class UnusedHeadNet(nn.Module):
    """Two wrapped HeadedBlocks and a root head; the root also holds a vector the forward never
    reads. Block 0's flat parameter: aux_head (4*29 + 4 = 120) then fc (13*29 + 29 = 406), ending
    at 534; block 1's: fc (11*29 + 11 = 330) then aux_head (2*11 + 2 = 24): both need tail padding
    at W = 4 and 8."""

    def __init__(self, in_features: int = 13, hidden: tuple[int, int] = (29, 11), out_features: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([HeadedBlock(in_features, hidden[0], 4, aux_first=True),
                                     HeadedBlock(hidden[0], hidden[1], 2, aux_first=False)])
        self.head = nn.Linear(hidden[1], out_features)
        self.unused_scale = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in) -> (B, out)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
