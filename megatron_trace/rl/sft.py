"""The SFT warm-up of the embedded demo: a tiny Qwen3-MoE trained with noisy labels, saved as an HF checkpoint.

RL then starts from that checkpoint directory: the same code path as starting from a real
pretrained checkpoint (``model.init_from``). The warm-up runs in transformers (fp32, fast on CPU).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from ..rollout.base import is_real  # (not a bool: a YAML ``true`` is no 1.0)
from .tasks import CharTokenizer, Task, sft_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TinyMoEConfig:
    """The demo model (Qwen3-MoE architecture)."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 64

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TinyMoEConfig.{f.name}={v!r} must be an int >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"TinyMoEConfig.top_k={self.top_k} must be <= num_experts={self.num_experts}")
        if self.top_k < 2:  # (the bridge refused it only when RL built the trainer, after the whole warm-up)
            raise ValueError(f"TinyMoEConfig.top_k={self.top_k} must be >= 2: the demo model normalises its top-k "
                             "routing weights (norm_topk_prob=True), and top-1 of those (every weight 1.0) is not "
                             "mapped to Megatron")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"TinyMoEConfig.num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    def hf_config(self, vocab_size: int, tok: CharTokenizer):
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=2 * self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, num_experts=self.num_experts, num_experts_per_tok=self.top_k,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            max_position_embeddings=self.max_position_embeddings, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=False, router_aux_loss_coef=0.0, output_router_logits=False,
            bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
        )


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    steps: int = 800
    batch_size: int = 64
    lr: float = 3e-3
    label_noise: float = 0.6
    seed: int = 0

    def __post_init__(self):
        for name, least in (("steps", 1), ("batch_size", 1), ("seed", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"SFTConfig.{name}={v!r} must be an int >= {least}")
        if not (is_real(self.lr) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"SFTConfig.lr={self.lr!r} must be > 0 (a finite number)")
        if not (is_real(self.label_noise) and 0 <= self.label_noise <= 1):
            raise ValueError(f"SFTConfig.label_noise={self.label_noise!r} must be in [0, 1] (the share of "
                             "warm-up answers replaced by wrong ones)")


def _settings(task: Task, model_cfg: TinyMoEConfig, sft: SFTConfig, device: str) -> dict:
    for name, v, cls, hint in (("task", task, Task, " (get_task(name) for a task)"),
                               ("model_cfg", model_cfg, TinyMoEConfig, ""), ("sft", sft, SFTConfig, "")):
        if not isinstance(v, cls):  # (a task name or a dict: AttributeError / asdict's TypeError)
            raise TypeError(f"{name} must be a {cls.__name__}{hint}, got {type(v).__name__} {v!r:.60}")
    # version 2 added the device type: warm-ups trained on cpu and cuda differ numerically (a version-1 stamp has
    # no device, so its checkpoint is retrained once)
    return {"task": task.name, "model": asdict(model_cfg), "sft": asdict(sft), "device": _device_type(device),
            "version": 2}


def _device_type(device: str | torch.device) -> str:
    """``"cpu"`` / ``"cuda"`` (``"cuda:1"`` trains the same numbers as ``"cuda"``: the key holds the type)."""
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:0')") from err


def sft_reusable(out_dir: str | Path, task: Task, model_cfg: TinyMoEConfig, sft: SFTConfig,
                 device: str = "cpu") -> bool:
    """Whether ``out_dir`` holds the checkpoint of exactly these settings, trained on this device type
    (``sft_checkpoint`` then trains nothing)."""
    out = Path(out_dir)
    stamp = out / "sft_settings.json"
    return (stamp.exists() and json.loads(stamp.read_text()) == _settings(task, model_cfg, sft, device)
            and (out / "config.json").exists())


def sft_checkpoint(out_dir: str | Path, task: Task, model_cfg: TinyMoEConfig, sft: SFTConfig,
                   progress=None, device: str = "cpu") -> Path:
    """Train (or reuse, when the same settings were trained before on the same device type) and return the HF
    checkpoint dir."""
    from transformers import Qwen3MoeForCausalLM

    out = Path(out_dir)
    key, stamp = _settings(task, model_cfg, sft, device), out / "sft_settings.json"
    if out.exists() and not out.is_dir():  # (refused by mkdir after the whole warm-up had trained)
        raise NotADirectoryError(f"out_dir={str(out)!r} is a file: give the checkpoint's directory (made if missing)")
    if progress is not None and not callable(progress):  # (failed at the first step's report)
        raise TypeError(f"progress={progress!r} must be None or a callable(step, loss)")
    if sft_reusable(out, task, model_cfg, sft, device):
        logger.info("reusing the SFT checkpoint in %s", out)
        return out
    if stamp.exists():
        old = json.loads(stamp.read_text())
        changed = sorted(k for k in {**old, **key} if old.get(k) != key.get(k))
        logger.info("the SFT checkpoint in %s has other settings (%s): training it again", out, ", ".join(changed))
    tok = CharTokenizer()
    torch.manual_seed(sft.seed)
    model = Qwen3MoeForCausalLM(model_cfg.hf_config(tok.vocab_size, tok)).float().to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.1, 1 - s / sft.steps))
    g = torch.Generator().manual_seed(sft.seed)
    for step in range(sft.steps):
        ids, mask = (t.to(device) for t in sft_batch(task, tok, sft.batch_size, g, sft.label_noise))
        logits = model(input_ids=ids).logits[:, :-1].float()
        target = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if progress is not None:
            progress(step, loss.item())
    out.mkdir(parents=True, exist_ok=True)
    # the old stamp goes first: a save that dies part-way must not leave it beside these weights (a later run with
    # its settings would take them for its own); the new one is written once the checkpoint is whole
    stamp.unlink(missing_ok=True)
    model.cpu().save_pretrained(out)
    stamp.write_text(json.dumps(key))
    return out
