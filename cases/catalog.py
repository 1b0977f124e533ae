"""The case catalog: the built-in cases, and how a case is found by name (a catalog name, or a
user's 'module:attr' / 'file.py:attr'). The Case API itself is cases/case.py, re-exported here:
`from cases.catalog import Case, OptimizerSpec, ParamGroup` is what a user's file writes."""

from __future__ import annotations

import dataclasses
import functools

import torch.nn as nn
import torch.nn.functional as F

from cases import architectures as arch
from cases.case import Case, OptimizerSpec, ParamGroup  # noqa: F401 (ParamGroup: re-exported for users)
from cases.data import image_batch, regression_batch, token_batch
from cases.features import Features
from cases.models import MLP, Block, TransformerConfig, TransformerLM, lm_loss

_STANDARD_OPTIMIZERS = (
    OptimizerSpec("sgd", lr=0.05, momentum=0.9),
    OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01),
)

# Flat parameters of the MLP (one per wrapped layer; the root owns layers.3):
#   layers.0: 31*13 + 31 = 434 (uneven at W = 4, 8), layers.1: 17*31 + 17 = 544 (even),
#   layers.2: 2*17 + 2 = 36 (uneven at W = 8), layers.3: 1*2 + 1 = 3 (< W: empty local shards).
_MLP_SIZES = (13, 31, 17, 2, 1)
_LM_CONFIG = TransformerConfig()
# Every catalog case runs at any world size up to 8; the default runs take 1, 2, 4 (8).
# Real ranks: up to MAX_CPU_WORLD_SIZE = 16 on a CPU host (harness/run/plan.py); simulated ranks
# (`--backend simulated`) at the common large counts up to 1024. A world size a case declares is
# also a batch split its error model measures where the split data's batch divides by it
# (harness/reference/shadow.py `_amplitude`): none above 16 at the catalog's batch sizes.
_ANY_WORLD_SIZE = tuple(range(1, 17)) + (24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
# The standard matrix and the gate run 10 steps: a bug that waits for step 6 (a buffer captured
# after a warm-up) acts in five of them. Measured with `python -m harness run --steps S` on this
# project's 2-core VM (32 cells): 35 s at 5 steps, 57 s at 10, 144 s at 30.
_STANDARD_STEPS = 10


def _mlp() -> nn.Module:
    return MLP(_MLP_SIZES)


def _transformer() -> nn.Module:
    return TransformerLM(_LM_CONFIG)


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case(
            name="mlp",
            world_sizes=_ANY_WORLD_SIZE,
            steps=_STANDARD_STEPS,
            description=f"MLP{_MLP_SIZES}, MSE regression; even, uneven and empty local shards",
            build_model=_mlp,
            wrap=("layers.0", "layers.1", "layers.2"),
            make_batch=regression_batch(_MLP_SIZES[0], _MLP_SIZES[-1]),
            loss_fn=F.mse_loss,
            optimizers=_STANDARD_OPTIMIZERS,
        ),
        Case(
            name="transformer",
            world_sizes=_ANY_WORLD_SIZE,
            steps=_STANDARD_STEPS,
            description=f"causal LM {_LM_CONFIG}: embeddings, attention, norms, MLP, head",
            build_model=_transformer,
            wrap=tuple(f"blocks.{i}" for i in range(_LM_CONFIG.n_layer)),
            make_batch=token_batch(_LM_CONFIG.vocab_size, _LM_CONFIG.block_size),
            loss_fn=lm_loss,
            optimizers=_STANDARD_OPTIMIZERS,
        ),
    )
}


# -- the seeds' FSDP features, one case each (issue: features) ------------------------------------
_FEATURE_WORLD_SIZES = _ANY_WORLD_SIZE
_TIED_CONFIG = TransformerConfig(tie_weights=True)
_TINY_SIZES = (3, 1, 2, 1)  # flat parameters of 4, 3 and 3 elements: numel < W, size-1 weights


def _lm_case(name: str, description: str, features: Features, config: TransformerConfig = _LM_CONFIG,
             wrap: tuple[str, ...] | None = None, build=None, optimizers=_STANDARD_OPTIMIZERS, **kw) -> Case:
    return Case(
        name=name,
        description=description,
        build_model=build or (lambda: TransformerLM(config)),
        wrap=wrap if wrap is not None else tuple(f"blocks.{i}" for i in range(config.n_layer)),
        make_batch=token_batch(config.vocab_size, config.block_size),
        loss_fn=lm_loss,
        optimizers=optimizers,
        world_sizes=_FEATURE_WORLD_SIZES,
        features=features,
        **kw,
    )


def _frozen_mlp() -> nn.Module:
    model = MLP(_MLP_SIZES)
    model.layers[1].weight.requires_grad_(False)  # frozen next to a trainable bias in one unit
    model.layers[3].bias.requires_grad_(False)
    return model


def _tiny_mlp() -> nn.Module:
    return MLP(_TINY_SIZES)


def _warmup_then_decay(optimizer):
    """Per group (blocks, then the default group of the root's parameters): a linear warm-up over 3
    steps for the blocks, a geometric decay for the rest: the learning rate differs between groups
    and from step to step."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, [lambda s: min(1.0, (s + 1) / 3), lambda s: 0.7 ** s])


# The blocks' parameters are a group of their own: each wrapped unit's parameters share one group,
# which an implementation with one flat parameter per unit can step.
_SCHEDULED_OPTIMIZERS = (
    OptimizerSpec("sgd", lr=0.05, momentum=0.9, param_groups=(ParamGroup(("blocks.*",), lr=0.1),),
                  lr_scheduler=_warmup_then_decay),
    OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01,
                  param_groups=(ParamGroup(("blocks.*",), lr=3e-3, weight_decay=0.1),),
                  lr_scheduler=_warmup_then_decay),
)

_FEATURE_CASES = (
    _lm_case("tied_embeddings", "output head tied to the token embedding in one unit (the root); tying "
             "across two units is refused with a clear error, which the cell asserts",
             Features(refused_wrap=("tok_emb", "head")), config=_TIED_CONFIG),
    _lm_case("tied_embeddings_grouped", "the tied token embedding and output head as one unit of two modules "
             "(fully_shard([tok_emb, head]), FSDP2's idiom), beside the blocks and the root",
             Features(wrap_groups=(("tok_emb", "head"),)), config=_TIED_CONFIG),
    Case(name="frozen_params", description="requires_grad=False weights mixed with trainable biases in one unit",
         build_model=_frozen_mlp, wrap=("layers.0", "layers.1", "layers.2"),
         make_batch=regression_batch(_MLP_SIZES[0], _MLP_SIZES[-1]), loss_fn=F.mse_loss,
         optimizers=_STANDARD_OPTIMIZERS, world_sizes=_FEATURE_WORLD_SIZES),
    Case(name="uneven_tiny", description=f"MLP{_TINY_SIZES}: size-1 weights, flat parameters smaller than W, "
         "empty local shards", build_model=_tiny_mlp, wrap=("layers.0", "layers.1"),
         make_batch=regression_batch(_TINY_SIZES[0], _TINY_SIZES[-1]), loss_fn=F.mse_loss,
         optimizers=_STANDARD_OPTIMIZERS, world_sizes=_ANY_WORLD_SIZE),
    _lm_case("meta_init", "built on the meta device, materialised per unit by reset_parameters(), then "
             "loaded from the reference state", Features(meta_init=True)),
    _lm_case("reshard_after_forward_false", "ZeRO-2 / SHARD_GRAD_OP: parameters stay unsharded from forward "
             "to backward, no re-gather", Features(reshard_after_forward=False)),
    _lm_case("no_shard", "NO_SHARD through the same API: a (W, 1) mesh, gradients all-reduced, state replicated",
             Features(mesh="no_shard")),
    _lm_case("hybrid_shard", "HSDP on a 2-D mesh: W = 4 as 2 replicas x 2 shards (W < 4: plain sharding)",
             Features(mesh="hybrid")),
    _lm_case("hybrid_shard_3", "HSDP with three replicas: W = 12 as 3 replicas x 4 shards, W = 6 as 3 x 2 "
             "(W not a multiple of 3, or below 6: plain sharding)", Features(mesh="hybrid", replicas=3)),
    _lm_case("zero1", "DeepSpeed ZeRO-1: replicated parameters and gradients, optimizer state sharded",
             Features(zero1=True)),
    _lm_case("mixed_precision", "bfloat16 compute with fp32 master weights, gradients reduced in fp32; the "
             "reference casts the same way; tolerances scaled to bfloat16",
             Features(param_dtype="bfloat16", reduce_dtype="float32")),
    _lm_case("mixed_precision_bf16_reduce", "bfloat16 compute and bfloat16 gradient reduction",
             Features(param_dtype="bfloat16", reduce_dtype="bfloat16")),
    _lm_case("grad_accumulation", "2 micro-batches per step, gradient sync skipped on the first; equal to one "
             "large batch", Features(grad_accum=2)),
    _lm_case("clip_grad_norm", "global gradient-norm clipping (L2) across shards, equal to clip_grad_norm_ "
             "on the unsharded model", Features(clip_norm_type=2.0, clip_max_norm=0.5)),
    _lm_case("clip_grad_norm_inf", "global gradient-norm clipping (inf norm) across shards",
             Features(clip_norm_type=float("inf"), clip_max_norm=0.05)),
    _lm_case("hybrid_shard_clip", "HSDP with L2 gradient-norm clipping: the norm sums each shard group's "
             "shards once, not once per replica (W = 4: 2 replicas x 2 shards)",
             Features(mesh="hybrid", clip_norm_type=2.0, clip_max_norm=0.5)),
    _lm_case("activation_checkpointing", "every block recomputed in backward (non-reentrant checkpoint) "
             "inside its wrapped unit", Features(activation_checkpointing=("blocks.0", "blocks.1"))),
    _lm_case("prefetch", "forward prefetch of the next block and backward prefetch of the previous one",
             Features(prefetch=True)),
    _lm_case("auto_wrap", "units chosen by a transformer-layer-class policy (transformer_layer_cls_to_wrap)",
             Features(auto_wrap="layer_class", expected_units=("blocks.0", "blocks.1", "")), wrap=()),
    _lm_case("auto_wrap_size", "units chosen by a size policy (min_num_params=1000)",
             Features(auto_wrap="size", auto_wrap_min_params=1000,
                      expected_units=("blocks.0.attn", "blocks.0.fc", "blocks.0.out",
                                      "blocks.1.attn", "blocks.1.fc", "blocks.1.out", "")), wrap=()),
    _lm_case("state_dict_reshard", "sharded checkpoint after steps 2 and 3, reloaded with half the shard "
             "size and then unsharded (W = 4: 4 -> 2 -> 1 shards), optimizer state included; at the end "
             "a full state dict saved by rank 0 reloads bitwise", Features(checkpoint_reshard_at=(2, 3))),
    _lm_case("lr_schedule", "parameter groups (the blocks with their own lr and weight decay) and an LR scheduler "
             "with one schedule per group (warm-up, decay), stepped after every optimizer step",
             Features(), optimizers=_SCHEDULED_OPTIMIZERS),
    _lm_case("cpu_offload", "parameters and optimizer state on the CPU, compute on the accelerator",
             Features(cpu_offload=True, requires_device="cuda")),
)
CASES.update({case.name: case for case in _FEATURE_CASES})


# -- real architectures (cases/architectures.py; the Hugging Face ones need the `models` extra) -
def _hf_case(name: str, description: str, build, wrap=arch.decoder_blocks, make_batch=arch.causal_lm_batch,
             loss_fn=arch.causal_lm_loss) -> Case:
    return Case(name=name, description=description, build_model=build, wrap=wrap, make_batch=make_batch,
                loss_fn=loss_fn, optimizers=_STANDARD_OPTIMIZERS, tags=("architecture",), requires=("transformers",),
                world_sizes=_ANY_WORLD_SIZE)


_BATCHNORM_SPLIT = (
    "BatchNorm normalises over each rank's local batch, so under split data a rank's statistics are "
    "not the global batch's and the run is not the unsharded one by design; use identical data "
    "(nn.SyncBatchNorm, which would share the statistics, runs only on GPUs: on CPU ranks it raises)")
_ARCHITECTURE_CASES = (
    _hf_case("gpt2", "Hugging Face GPT-2: learned positions, token embedding tied to the output head (the "
             "seeds' model), 2 blocks wrapped", arch.gpt2),
    _hf_case("llama", "Hugging Face Llama: RoPE, RMSNorm, grouped-query attention (4 heads, 2 KV heads), "
             "SwiGLU, 2 decoder layers wrapped", arch.llama),
    _hf_case("moe", "Hugging Face Mixtral: a router sends each token to 2 of 4 experts (some experts get "
             "no token of a rank's batch), 2 decoder layers wrapped", arch.mixtral),
    _hf_case("qwen2", "Hugging Face Qwen2: grouped-query attention (6 heads, 2 KV heads) with q/k/v biases, "
             "RoPE, token embedding tied to the output head, 2 decoder layers wrapped", arch.qwen2),
    _hf_case("t5", "Hugging Face T5 encoder-decoder: relative position bias passed from the first block on, "
             "cross attention, one embedding shared by encoder, decoder and head, the model's own loss from "
             "labels; 2 encoder and 2 decoder blocks wrapped", arch.t5, wrap=arch.layer_blocks,
             make_batch=arch.t5_batch, loss_fn=arch.model_loss),
    _hf_case("bert", "Hugging Face BERT sequence classifier on padded samples (attention mask, 4 to 16 of 16 "
             "tokens), a per-sample mean loss; 2 layers wrapped", arch.bert, wrap=arch.layer_blocks,
             make_batch=arch.padded_classification_batch, loss_fn=arch.classification_loss),
    _hf_case("vit", "Hugging Face ViT image classifier: 4x4 patches of 8x8 images, a class token, learned "
             "positions; 2 layers wrapped", arch.vit, wrap=arch.layer_blocks,
             make_batch=arch.image_classification_batch, loss_fn=arch.classification_loss),
    Case(name="unused_head", description="an auxiliary head in each wrapped unit and a root vector that the "
         "loss never reaches: parameters without gradients beside ones with", build_model=arch.UnusedHeadNet,
         wrap=("blocks.0", "blocks.1"), make_batch=regression_batch(13, 3), loss_fn=F.mse_loss,
         optimizers=_STANDARD_OPTIMIZERS, tags=("architecture",), world_sizes=_ANY_WORLD_SIZE),
    Case(name="batchnorm", description="ConvNet with BatchNorm2d (batch statistics, running buffers); "
         "identical data only: " + _BATCHNORM_SPLIT.split(", so")[0], build_model=arch.SmallConvNet,
         wrap=("block1", "block2"), make_batch=image_batch(3, 6, 5), loss_fn=F.cross_entropy,
         optimizers=_STANDARD_OPTIMIZERS, data_modes=("identical",), refused_modes=(("split", _BATCHNORM_SPLIT),),
         tags=("architecture",), world_sizes=_ANY_WORLD_SIZE),
)
CASES.update({case.name: case for case in _ARCHITECTURE_CASES})
LAYER_CLASSES = {"Block": Block}


# A case run with another global batch than it declares: "<case>@batch=<B>" (see with_global_batch).
BATCH_SUFFIX = "@batch="


def get_case(name: str) -> Case:
    """A catalog case by name, or a user's case by 'module:attr' / 'file.py:attr' (cases/user.py);
    either with "@batch=<B>" appended is that case with global batch B (`with_global_batch`)."""
    base, suffix, batch = name.rpartition(BATCH_SUFFIX)
    if suffix:
        return _with_batch(base, batch)
    if ":" in name:
        return _user_case(name)
    try:
        return CASES[name]
    except KeyError:
        raise ValueError(f"unknown case {name!r}; known cases: {sorted(CASES)}, or give 'module:attr' / "
                         f"'file.py:attr' naming your own Case") from None


@functools.lru_cache(maxsize=None)
def _user_case(spec: str) -> Case:
    from cases.user import load_case  # cases/user.py imports Case from here

    return load_case(spec)


def with_global_batch(name: str, global_batch: int) -> str:
    """The name under which case `name` runs with `global_batch` samples per step (itself when that
    is the batch it declares). A run that splits the batch over world sizes the declared batch does
    not divide runs every cell and the reference of the case on such a batch: the same case, another
    training run, named apart in its cells, initial state and reports."""
    base = name.rpartition(BATCH_SUFFIX)[0] or name
    return base if get_case(base).global_batch == global_batch else f"{base}{BATCH_SUFFIX}{global_batch}"


@functools.lru_cache(maxsize=None)
def _with_batch(base: str, batch: str) -> Case:
    case = get_case(base)
    if not batch.isdigit() or int(batch) < 1:
        raise ValueError(f"case {base}{BATCH_SUFFIX}{batch}: the global batch must be a positive integer")
    return dataclasses.replace(case, name=f"{case.name}_batch{batch}", global_batch=int(batch))
