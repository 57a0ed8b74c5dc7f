"""TRACE RL demo (Hydra entry point). `make demo` runs it; see examples/conf/demo.yaml for every setting."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

from megatron_trace.config import from_hydra, register_hydra
from megatron_trace.rl import report
from megatron_trace.rl.demo import run
from megatron_trace.rl.driver import RLConfig
from megatron_trace.rl.sft import SFTConfig, TinyMoEConfig

register_hydra()
# Megatron-Core warns at import and build time about Apex/TE being absent (it falls back to torch): expected here.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")


@hydra.main(config_path="conf", config_name="demo", version_base=None)
def main(cfg: DictConfig) -> None:
    out = Path(cfg.output_dir)
    logging.getLogger("megatron_trace").setLevel(logging.INFO if cfg.verbose else logging.WARNING)
    by_arm = run(
        out_dir=out, task_name=cfg.task, arms=list(cfg.arms), trace=from_hydra(cfg.trace),
        rl=RLConfig(**cfg.rl), model=TinyMoEConfig(**cfg.model), sft=SFTConfig(**cfg.sft),
        init_from=cfg.init_from, sft_cache=Path("outputs") / "sft_cache" / cfg.task, device=cfg.device,
        resume=cfg.resume, progress=cfg.progress,
    )
    if not by_arm:
        print("no arms: SFT warm-up checkpoint prepared, nothing else to do")
        return
    print(report.markdown_table(report.summary_rows(by_arm)))
    print(f"\nmetrics: {out / 'metrics.jsonl'}  summary: {out / 'summary.md'}  plots: {out}/*.png")


if __name__ == "__main__":
    main()
