"""Launch an SGLang TRACE rollout engine next to a Megatron trainer (needs SGLang 0.5.10.post1 on a GPU).

  1. export the initial policy as a TRACE/ModelOpt NVFP4 checkpoint (once, on any machine):
       python examples/sglang/launch_rollout.py export --hf-dir <bf16 HF checkpoint> --out <ckpt dir> --input-amax <A>
  2. start the engine and sample (on the rollout GPUs):
       python examples/sglang/launch_rollout.py serve --ckpt <ckpt dir> --tp 1
     In an RL job the trainer holds an ``SGLangRolloutBackend`` and calls ``generate`` / ``update_weights``
     (``WeightsUpdateGroup`` for NCCL sync from trainer rank 0, like slime).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

logger = logging.getLogger("launch_rollout")


def export(hf_dir: str, out: str, input_amax: float) -> None:
    from safetensors.torch import load_file

    from megatron_trace.bridge.sync import fp4_stream
    from megatron_trace.config import TraceConfig
    from megatron_trace.export import save_modelopt_checkpoint

    cfg = TraceConfig(kv_format="sglang_kvfp4")  # K/V as SGLang's fp4_e2m1 KV cache stores them, on both sides
    hf_config = json.load(open(os.path.join(hf_dir, "config.json")))
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    named = [(k, v) for f in files for k, v in load_file(os.path.join(hf_dir, f)).items()]
    save_modelopt_checkpoint(out, fp4_stream(named, cfg.weight_quantizer()), hf_config, input_amax,
                             trace_extras=True, trace_config=cfg.to_dict())
    for f in side_files(hf_dir):  # tokenizer, chat template and generation files travel with the checkpoint
        with open(os.path.join(hf_dir, f), "rb") as src, open(os.path.join(out, f), "wb") as dst:
            dst.write(src.read())


CHECKPOINT_FILES = ("config.json", "hf_quant_config.json")
"""What the export writes itself (a source's copy would overwrite the export's); weights and their indexes too."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf", ".onnx", ".index.json")


def side_files(hf_dir: str) -> list[str]:
    """The files of ``hf_dir`` that are not the checkpoint's weights or configs: tokenizer files, the chat template
    (``chat_template.jinja``, which transformers writes beside the tokenizer), generation config, README. (Copying
    only .json / .txt / .model files left the chat template behind, silently.)"""
    return sorted(f for f in os.listdir(hf_dir) if os.path.isfile(os.path.join(hf_dir, f))
                  and f not in CHECKPOINT_FILES and not f.endswith(WEIGHT_SUFFIXES))


def serve(ckpt: str, tp: int) -> None:
    from megatron_trace.config import TraceConfig
    from megatron_trace.rollout.base import SamplingParams
    from megatron_trace.rollout.sglang import SGLangRolloutBackend, make_engine, trace_server_args

    cfg = TraceConfig.from_dict(json.load(open(os.path.join(ckpt, "hf_quant_config.json")))["trace"])
    hf_config = json.load(open(os.path.join(ckpt, "config.json")))
    # chunked prefill and the radix cache stay on: guidance is stored per KV slot and read out per request
    # (trace_server_args rejects the settings the capture cannot handle, see launch.REQUIRED); CUDA graphs stay on
    # with Blackwell's native MoE, the Hopper emulation runs without them (disable_cuda_graph=True)
    engine = make_engine(cfg, **trace_server_args(ckpt, cfg, hf_config, tp_size=tp))
    # SGLang's FP4 KV cache stores sglang_kvfp4; the exported TraceConfig says kv_format="sglang_kvfp4", so the
    # trainer quantizes K/V the same way and the KV records guide it (another kv_format is refused, naming it)
    backend = SGLangRolloutBackend(engine, cfg, hf_config)
    batch = backend.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=16, temperature=1.0, seed=0))
    covered = {k: float(g.valid.float().mean()) for k, g in batch.guidance.items()}
    logger.info("sampled %s; guidance coverage per (layer, site): %s", batch.responses(), covered)
    engine.shutdown()


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--hf-dir", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--input-amax", type=float, required=True,
                   help="static activation amax for input_scale (used by native Blackwell kernels only), e.g. "
                        "the largest per-row amax recorded in a calibration rollout")
    s = sub.add_parser("serve")
    s.add_argument("--ckpt", required=True)
    s.add_argument("--tp", type=int, default=1)
    a = p.parse_args()
    if a.cmd == "export":
        export(a.hf_dir, a.out, a.input_amax)
    else:
        serve(a.ckpt, a.tp)


if __name__ == "__main__":
    main()
