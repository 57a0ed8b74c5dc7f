"""Run in a subprocess by test_megatron_lm_patch.py from a patched Megatron-LM tree (the cwd): parse its command line
with the patched ``pretrain_gpt.extra_args_provider``, build the model with the patched ``gpt_builder`` on CPU (gloo,
the test shims), run one forward and backward, and print what was built as one JSON line."""

import json
import os
import sys

import torch

from megatron_trace.testing.megatron_cpu import apply_cpu_shims, free_port

apply_cpu_shims()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
torch.distributed.init_process_group("gloo", rank=0, world_size=1)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)

import pretrain_gpt  # noqa: E402  (the patched launcher: its extra_args_provider)
from gpt_builders import gpt_builder  # noqa: E402
from megatron.training import training  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args  # noqa: E402
from megatron.training.global_vars import set_args  # noqa: E402

sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
args = parse_args(extra_args_provider=pretrain_gpt.extra_args_provider)
validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
args.padded_vocab_size = args.vocab_size  # (set by the tokenizer in a real launch)
set_args(args)
model = gpt_builder(args, True, True, config=core_transformer_config_from_args(args))
seq = args.seq_length
tokens = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
mask = torch.triu(torch.ones(1, 1, seq, seq), 1).bool()
loss = model(tokens, torch.arange(seq).expand(2, seq), mask, labels=tokens).float().mean()
loss.backward()
grads = [p.grad for n, p in model.named_parameters() if ".experts." in n]
print(json.dumps({
    "trace_fp4": bool(getattr(args, "trace_fp4", False)),
    "modules": sorted({type(m).__name__ for m in model.modules()}),
    "loss": loss.item(),
    "expert_grads": len(grads),
    "expert_grads_nonzero": sum(int(g is not None and bool(g.abs().sum() > 0)) for g in grads),
    "train_step_scope": getattr(training, "trace_train_step", None) is not None,
}))
