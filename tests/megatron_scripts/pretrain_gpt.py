"""A Megatron-LM-style GPT pretraining entry script on ``megatron.training.pretrain``.

Written for these tests, after the shape of Megatron-LM's ``pretrain_gpt.py``: Megatron-LM's
own argument parser, initialisation, training loop, logging and checkpointing (everything
``megatron.training`` does), with a GPT model provider and a synthetic token dataset of our
own. megatron-core 0.17+ ship ``megatron.training`` in their wheels and sdists, so it runs
without a Megatron-LM checkout. Run it the way Megatron-LM is run with the plugin:

    torchrun --nproc-per-node N -m uccl_ep_megatron.run tests/megatron_scripts/pretrain_gpt.py \\
        --num-layers 4 --hidden-size 512 ... --num-experts 8 --expert-model-parallel-size N \\
        --moe-token-dispatcher-type uccl_ep --tokenizer-type NullTokenizer --vocab-size 4096

Without Transformer Engine pass ``NO_TE_FLAGS`` (below; docs/megatron.md lists them). The model is
``megatron.core.models.gpt.GPTModel`` on megatron-core's layer specs (Transformer Engine's with
``--transformer-impl transformer_engine``, the local ones otherwise); data are windows of
``--seq-length + 1`` tokens drawn from a generator seeded by ``--seed`` and the sample index,
so two runs with the same flags see the same batches whatever the dispatcher.

``pretrain`` changed its signature between releases; ``main()`` calls each the way that
release's Megatron-LM ``pretrain_gpt.py`` does: 0.17 parses arguments inside ``pretrain``,
0.18 takes a ``PretrainConfigContainer`` first and the provider positionally, 0.19 takes the
provider as a keyword (the container's model config left empty).
"""

from __future__ import annotations

import functools
import inspect

import torch
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args

ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer"}

# Megatron-LM flags for a run without Transformer Engine or Apex (docs/megatron.md lists them):
# local layers, no fused kernels that need either.
NO_TE_FLAGS = (
    "--transformer-impl local --no-persist-layer-norm --disable-bias-linear "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion"
).split()


def example_args(ep: int, dispatcher: str, iters: int) -> list[str]:
    """The flags the tests run: a 4-layer MoE GPT (16 experts, top-4), EP ``ep``, BF16."""
    model = (
        "--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 2816 "
        "--seq-length 1024 --max-position-embeddings 1024 --position-embedding-type rope "
        "--normalization RMSNorm --swiglu --untie-embeddings-and-output-weights "
        "--attention-dropout 0 --hidden-dropout 0 "
        "--num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 704 --moe-router-dtype fp32 "
        "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3"
    ).split()
    training = (
        f"--micro-batch-size 2 --global-batch-size 16 --train-iters {iters} --lr 3e-4 "
        "--min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 "
        "--clip-grad 1.0 --bf16 --seed 1234 --log-interval 1 --eval-iters 0 "
        "--eval-interval 1000000 --tokenizer-type NullTokenizer --vocab-size 8192"
    ).split()
    parallel = f"--tensor-model-parallel-size 1 --expert-model-parallel-size {ep}".split()
    return [*model, *training, *parallel, *NO_TE_FLAGS, "--moe-token-dispatcher-type", dispatcher]


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config=None,
    pg_collection=None,
) -> GPTModel:
    """GPTModel from megatron-core's layer specs (MoE layers where ``--num-experts`` is set)."""
    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec()
    kwargs = dict(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )
    accepted = inspect.signature(GPTModel.__init__).parameters
    for name, value in (("vp_stage", vp_stage), ("pg_collection", pg_collection)):
        if name in accepted and value is not None:
            kwargs[name] = value
    return GPTModel(**kwargs)


class SyntheticTokens(torch.utils.data.Dataset):
    """``size`` windows of ``seq_length + 1`` tokens; window ``i`` depends on ``(seed, i)`` only."""

    def __init__(self, size: int, seq_length: int, vocab_size: int, seed: int) -> None:
        self.size, self.seq_length, self.vocab_size, self.seed = size, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        return {"text": torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)}


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Synthetic train/valid/test sets of the sizes Megatron asks for."""
    args = get_args()
    vocab = args.padded_vocab_size
    sets = [
        SyntheticTokens(max(int(n), 1), args.seq_length, vocab, args.seed + k)
        for k, n in enumerate(train_val_test_num_samples)
    ]
    print_rank_0(f"> synthetic datasets of {[len(s) for s in sets]} windows")
    return tuple(sets)


# Every rank builds its own (deterministic) datasets; nothing is broadcast.
train_valid_test_datasets_provider.is_distributed = True


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-summed LM loss, the token count, and the ``lm loss`` Megatron-LM logs."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model: GPTModel):
    """One micro-batch: next-token targets, a causal mask, every position counted."""
    text = next(data_iterator)["text"].cuda(non_blocking=True)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    batch, seq = tokens.shape
    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, -1)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=tokens.device), 1)
    loss_mask = torch.ones(batch, seq, dtype=torch.float32, device=tokens.device)
    output = model(tokens, position_ids, causal[None, None], labels=labels)
    return output, functools.partial(loss_func, loss_mask)


def _keep_prebuilt_dataset_helpers() -> None:
    """Megatron-LM's initialisation runs ``make`` in ``megatron/core/datasets`` on rank 0 and
    exits when it fails. A Megatron-LM checkout has the Makefile; the megatron-core wheels ship
    the compiled ``helpers_cpp`` module instead and no Makefile, so the ``make`` always fails
    there. Keep the shipped module in that case (only then: a checkout still compiles)."""
    import os

    from megatron.core.datasets import utils as dataset_utils

    here = os.path.dirname(os.path.abspath(dataset_utils.__file__))
    if os.path.exists(os.path.join(here, "Makefile")):
        return
    import megatron.core.datasets.helpers_cpp  # noqa: F401  (raises if the wheel lacks it too)

    dataset_utils.compile_helpers = lambda: None


def main() -> None:
    """Call ``pretrain`` the way this release's Megatron-LM ``pretrain_gpt.py`` does."""
    _keep_prebuilt_dataset_helpers()
    params = list(inspect.signature(pretrain).parameters)
    common = dict(
        train_valid_test_dataset_provider=train_valid_test_datasets_provider,
        model_provider=model_provider,
        model_type=ModelType.encoder_or_decoder,
        forward_step_func=forward_step,
    )
    if params[0] != "cfg_container":  # 0.17: pretrain parses the arguments itself
        pretrain(args_defaults=ARGS_DEFAULTS, **common)
        return
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults=ARGS_DEFAULTS)
    pretrain(pretrain_cfg_container_from_args(args), **common)


if __name__ == "__main__":
    main()
