"""The causal LM that every chapter plugs into. Which class implements a mixer, feed-forward or residual type is
decided here, in three tables; chapters add implementations without touching the trainer."""
import importlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_book.config import ModelConfig, ConfigError
from moe_book.layers.base import RMSNorm

# name -> "module:Class". Import happens only when a config asks for the type, so a chapter that is not
# written yet fails with a message, not an ImportError at import time.
MIXERS = {
    "attn": ("moe_book.layers.base:CausalSelfAttention", "00"),
    "kda": ("moe_book.layers.kda:KimiDeltaAttention", "01"),
    "mla": ("moe_book.layers.mla:GatedMLA", "03"),
}
FFNS = {
    "mlp": ("moe_book.layers.base:SwiGLU", "00"),
    "moe": ("moe_book.layers.moe:LatentMoE", "05"),
}
RESIDUALS = {
    "plain": ("moe_book.model:PlainResidual", "00"),
    "attnres": ("moe_book.layers.attnres:AttnRes", "04"),
    "block_attnres": ("moe_book.layers.attnres:BlockAttnRes", "04"),
}


def resolve(table: dict, name: str, what: str):
    "The class registered under `name`, with a clear error when its chapter has not been exported yet."
    if name not in table:
        raise ConfigError(f"unknown {what} {name!r}: choose one of {sorted(table)}")
    path, chapter = table[name]
    module, cls = path.split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what} {name!r} is built in chapter {chapter} ({path}), which is not in this checkout "
                          f"yet ({e}); pick another {what} or run `make export`") from None


class PlainResidual(nn.Module):
    "The standard stream: x <- x + f(norm(x)) for every sublayer f. Chapter 04 replaces it with AttnRes."
    def __init__(self, cfg: ModelConfig):
        super().__init__()

    def begin(self, x):            # the state carried between sublayers
        return x

    def read(self, state, i: int):  # input of sublayer i (before its pre-norm)
        return state

    def write(self, state, i: int, out):
        return state + out

    def end(self, state):
        return state


class Block(nn.Module):
    "One layer = a token mixer sublayer and a feed-forward sublayer, each with its own pre-norm."
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.mixer_type, self.ffn_type = cfg.mixer_of(layer), cfg.ffn_of(layer)
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = resolve(MIXERS, self.mixer_type, "mixer")(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = resolve(FFNS, self.ffn_type, "ffn")(cfg, layer)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.residual = resolve(RESIDUALS, cfg.residual, "residual")(cfg)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self):
        "GPT-2 style init: N(0, std), residual-output projections scaled by 1/sqrt(2 * n_layers); then each module's own."
        std = self.cfg.init_std
        for m in self.modules():
            if isinstance(m, nn.Linear):
                s = std / math.sqrt(2 * self.cfg.n_layers) if getattr(m, "is_residual_out", False) else std
                nn.init.normal_(m.weight, 0.0, s)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)
        for m in self.modules():
            if m is not self and hasattr(m, "init_weights"):
                m.init_weights()

    def hidden(self, idx, cache=None):
        "Final-norm hidden states (B, T, d). `cache` (chapter 03) carries decode state per layer."
        x = self.embed(idx)
        state = self.residual.begin(x)
        for i, blk in enumerate(self.layers):
            kw = {} if cache is None else {"cache": cache[i]}
            state = self.residual.write(state, 2 * i, blk.mixer(blk.mixer_norm(self.residual.read(state, 2 * i)), **kw))
            state = self.residual.write(state, 2 * i + 1, blk.ffn(blk.ffn_norm(self.residual.read(state, 2 * i + 1))))
        return self.norm(self.residual.end(state))

    def forward(self, idx, targets=None, cache=None):
        """Logits (B, T, V); with targets also the loss: mean token cross-entropy plus any auxiliary losses that
        sublayers left in `.aux_loss` during this forward (e.g. a MoE balancing loss)."""
        logits = self.lm_head(self.hidden(idx, cache))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        aux = [m.aux_loss for m in self.modules() if getattr(m, "aux_loss", None) is not None]
        return logits, (loss + sum(aux)) if aux else loss

    def post_step(self):
        "Called by the trainer after each optimizer step: non-gradient updates (e.g. router biases)."
        for m in self.modules():
            if m is not self and hasattr(m, "post_step"):
                m.post_step()

    def step_metrics(self) -> dict:
        "Per-step numbers the sublayers report (e.g. expert loads, MaxVio), merged into one dict."
        out = {}
        for m in self.modules():
            if m is not self and hasattr(m, "step_metrics"):
                out.update(m.step_metrics())
        return out

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding else n
