"""Run in a subprocess by test_megatron_lm_patch.py from a patched Megatron-LM tree (the cwd), for each case of the JSON
list in ``argv[1]`` (``{"id", "argv", "stop"}``): parse ``argv`` with the patched ``pretrain_gpt.extra_args_provider``
and Megatron's ``validate_args``, build the model as ``pretrain_gpt.py`` does (``model_provider(gpt_builder)``, the
patched builder) on CPU (gloo, the test shims), and run one forward and backward inside the patched ``train_step``'s
``trace_train_step``, then one forward-only pass and the patched ``evaluate``'s ``trace_eval_done``. ``"stop":
"parse"`` / ``"build"`` stops after that stage; ``"evaluate"`` runs only the forward-only pass, between
``trace_eval_start`` and ``trace_eval_done`` (``--skip-train``). One JSON line per case: what was built, or
``{"stage", "error": type, "message", "raised_in": the file that raised it (from its package's folder)}`` (argparse's
exit: ``"SystemExit"``, its message in ``"stderr"``); ``"warnings"``: what megatron_trace logged.

The cases share one process (Megatron's import is most of the time); each parses its own command line."""

import contextlib
import inspect
import io
import json
import logging
import os
import sys
import traceback

import torch

from megatron_trace.testing.megatron_cpu import apply_cpu_shims, free_port


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_case(argv: list[str], stop: str, facts: dict) -> None:
    import pretrain_gpt  # the patched launcher: its extra_args_provider
    from gpt_builders import gpt_builder
    from megatron.core.enums import ModelType
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training import training
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args
    from model_provider import model_provider

    from megatron_trace.megatron import trace_config_from_args

    facts["stage"] = "parse"
    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args(extra_args_provider=pretrain_gpt.extra_args_provider)
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    args.padded_vocab_size = args.vocab_size  # (set by the tokenizer in a real launch)
    args.model_type = ModelType.encoder_or_decoder  # (set by pretrain())
    set_args(args)
    facts["trace_fp4"] = bool(getattr(args, "trace_fp4", False))
    if stop == "parse":
        return

    facts["stage"] = "build"
    model_parallel_cuda_manual_seed(1)
    model = model_provider(gpt_builder, True, True)  # what pretrain_gpt.py builds each model chunk with
    facts["modules"] = sorted({type(m).__name__ for m in model.modules()})
    facts["mtp_modules"] = sorted({type(m).__name__ for n, m in model.named_modules() if ".mtp." in f".{n}."})
    if facts["trace_fp4"]:
        facts["trace_config"] = trace_config_from_args(args).to_dict()
    if stop == "build":
        return

    seq = args.seq_length
    tokens = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(1, 1, seq, seq), 1).bool()
    # the patched evaluate() starts with trace_eval_start and ends in trace_eval_done (its NaN/Inf counts are reported
    # there, not by the next step)
    source = inspect.getsource(training.evaluate)
    facts["evaluate_calls_trace_eval_start"] = "trace_eval_start(args, model)" in source
    facts["evaluate_calls_trace_eval_done"] = "trace_eval_done(args, model)" in source
    if stop == "evaluate":  # --skip-train: an evaluation with no train step before it
        facts["stage"] = "evaluate"
        training.trace_eval_start(args, [model])
        with torch.no_grad():
            model(tokens, torch.arange(seq).expand(2, seq), mask, labels=tokens)
        training.trace_eval_done(args, [model])
        facts["evaluated"] = True
        return

    facts["stage"] = "train_step"
    with training.trace_train_step(args, model):  # what the patched train_step runs the micro-batches in
        loss = model(tokens, torch.arange(seq).expand(2, seq), mask, labels=tokens).float().mean()
        loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if ".experts." in n]
    with torch.no_grad():  # (with labels, as Megatron's evaluation passes them: an MTP model needs them)
        model(tokens, torch.arange(seq).expand(2, seq), mask, labels=tokens)
    training.trace_eval_done(args, [model])
    facts.update(
        loss=loss.item(),
        expert_grads=len(grads),
        expert_grads_nonzero=sum(int(g is not None and bool(g.abs().sum() > 0)) for g in grads),
    )


def _raised_in(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1].filename.replace(os.sep, "/")
    for top in ("megatron_trace/", "megatron/", "torch/", "argparse"):
        if top in where:
            return top + where.split(top, 1)[1]
    return where


def main() -> None:
    apply_cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    import pretrain_gpt  # noqa: F401  (imported before stderr is redirected: Megatron's faulthandler needs its fileno)
    warnings = _Warnings()
    logging.getLogger("megatron_trace").addHandler(warnings)
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    for case in cases:
        facts, stderr = {"id": case["id"]}, io.StringIO()
        warnings.messages = facts["warnings"] = []
        try:
            with contextlib.redirect_stderr(stderr):
                run_case(case["argv"], case.get("stop", ""), facts)
        except (Exception, SystemExit) as e:  # reported to the test, which asserts on it
            facts.update(error=type(e).__name__, message=str(e), raised_in=_raised_in(e),
                         stderr=stderr.getvalue()[-2000:], traceback=traceback.format_exc()[-3000:])
        print(json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
