"""Every knob of the book in one place: dataclasses, two presets, and `key=value` overrides with clear errors."""
import dataclasses
import typing
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and how to fix it."""


@dataclass
class KDAConfig:
    "Kimi Delta Attention (chapter 01): per-channel bounded decay, delta-rule state of head_dim x head_dim per head."
    n_heads: int = 4
    head_dim: int = 32
    gate: str = "bounded"    # "bounded": g = g_min * sigmoid(x);  "softplus": g = -exp(A) * softplus(x) (unbounded)
    g_min: float = -5.0      # lower bound of the bounded log-decay, in [-6, -3]
    gate_rank: int = 16      # low-rank gate projection d_model -> gate_rank -> n_heads*head_dim
    conv_size: int = 4       # short causal depthwise convolution on q, k, v
    chunk_size: int = 64
    backend: str = "auto"    # "auto" (Triton on CUDA, chunked torch on CPU), "torch", "triton"


@dataclass
class MLAConfig:
    "Gated Multi-head Latent Attention (chapter 03)."
    n_heads: int = 4
    q_lora: int = 0          # 0: full-rank query projection
    kv_lora: int = 64
    qk_nope: int = 32
    qk_rope: int = 16
    v_head: int = 32
    rope: bool = False       # NoPE by default: KDA layers carry position
    rope_theta: float = 10000.0
    gate: str = "head"       # "none", "head" (one scalar per head and token), "channel" (elementwise)


@dataclass
class MoEConfig:
    "Stable Latent MoE (chapter 05)."
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 128      # hidden width of each routed expert
    n_shared: int = 1        # always-on shared experts (same width as a routed one)
    latent_dim: int = 0      # 0: no latent projection (experts work at d_model)
    act: str = "situ"        # "situ" (SiTU-GLU) or "swiglu"
    route_scale: float = 1.0
    balancer: str = "quantile"  # "none", "aux_loss", "sign_bias", "quantile", ...
    aux_loss_coef: float = 1e-2
    bias_update_rate: float = 1e-3
    balance_window: int = 8


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    max_seq_len: int = 256
    # Token mixer per layer: every `global_every`-th layer (1-based) uses `global_mixer`, the rest `mixer`.
    mixer: str = "attn"
    global_mixer: str = "attn"
    global_every: int = 4
    n_heads: int = 4         # baseline softmax attention ("attn")
    head_dim: int = 32
    rope_theta: float = 10000.0
    # Feed-forward per layer: the first `first_dense` layers use a dense SwiGLU of width d_ff_dense.
    ffn: str = "mlp"
    d_ff: int = 512
    first_dense: int = 0
    d_ff_dense: int = 512
    # How sublayer outputs are combined into the next sublayer's input.
    residual: str = "plain"
    attnres_block: int = 4   # layers per block for block_attnres
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def mixer_of(self, layer: int) -> str:
        "Token-mixer type of layer `layer` (0-based)."
        return self.global_mixer if (layer + 1) % self.global_every == 0 else self.mixer

    def ffn_of(self, layer: int) -> str:
        "Feed-forward type of layer `layer` (0-based)."
        return "mlp" if layer < self.first_dense else self.ffn


@dataclass
class DataConfig:
    dir: str = "data/cache"       # shards, tokenizer and manifest go to <dir>/<name>
    name: str = "tiny"
    max_corpus_mb: float = 12.0   # text read from the machine (stdlib first, then site-packages)
    tokenizer_sample_mb: float = 12.0
    heldout_percent: float = 5.0  # share of *packages* held out (hash of the package name)
    long_doc_min_tokens: int = 100_000
    shard_tokens: int = 50_000_000


@dataclass
class TrainConfig:
    seed: int = 1337
    device: str = "auto"          # "auto", "cpu", "cuda"
    batch_size: int = 8
    seq_len: int = 256
    tokens: int = 0               # token budget; 0 means use `steps`
    steps: int = 300
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 10
    ckpt_every: int = 100
    keep_ckpts: int = 2
    out_dir: str = "runs/tiny"
    live: str = "auto"            # rich live panel: "auto" (when stdout is a terminal), "on", "off"
    compile: bool = False


@dataclass
class Config:
    preset: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def tiny() -> Config:
    "CPU/CI preset: vocab 4K, d 128, 4 layers (the hybrid puts KDA at 3 and Gated MLA at 1), seq 256."
    return Config(preset="tiny")


def small() -> Config:
    "The reference GPU preset (one H200); the peer is HF KimiLinear at the same shape."
    model = ModelConfig(
        vocab_size=32768, d_model=1024, n_layers=16, max_seq_len=4096,
        n_heads=8, head_dim=128, d_ff=2816, d_ff_dense=2816, global_every=4, attnres_block=4,
        kda=KDAConfig(n_heads=8, head_dim=128, gate_rank=128),
        mla=MLAConfig(n_heads=8, kv_lora=256, qk_nope=64, qk_rope=32, v_head=128),
        moe=MoEConfig(n_experts=128, top_k=8, d_expert=256, n_shared=1, latent_dim=512),
    )
    data = DataConfig(name="small", max_corpus_mb=600.0, tokenizer_sample_mb=120.0)
    train = TrainConfig(batch_size=8, seq_len=4096, steps=0, tokens=60_000_000, lr=1.5e-3, warmup_steps=50,
                        eval_every=100, eval_batches=4, log_every=5, ckpt_every=200, out_dir="runs/small")
    return Config(preset="small", model=model, data=data, train=train)


PRESETS = {"tiny": tiny, "small": small}

# The implementations each name refers to live in moe_book.model (MIXERS, FFNS, RESIDUALS).
MIXER_TYPES = ("attn", "kda", "mla")
FFN_TYPES = ("mlp", "moe")
RESIDUAL_TYPES = ("plain", "attnres", "block_attnres")


def _parse(value: str, typ, key: str):
    "Turn the text of an override into the field's type."
    if typ is bool:
        low = value.lower()
        if low in ("1", "true", "yes", "on"): return True
        if low in ("0", "false", "no", "off"): return False
        raise ConfigError(f"{key}={value!r}: expected a boolean (true/false)")
    if typ in (int, float):
        try:
            num = float(value.replace("_", "")) if typ is float else int(float(value.replace("_", "")))
        except ValueError:
            raise ConfigError(f"{key}={value!r}: expected {typ.__name__}") from None
        if typ is int and float(value.replace("_", "")) != num:
            raise ConfigError(f"{key}={value!r}: expected a whole number")
        return num
    return value


def _leaves(obj, prefix=""):
    "Yield (dotted_key, owner, field) for every leaf field of nested dataclasses."
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        val = getattr(obj, f.name)
        if dataclasses.is_dataclass(val):
            yield from _leaves(val, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", obj, f.name, hints[f.name]


def apply_overrides(cfg: Config, overrides) -> Config:
    """Apply `key=value` strings. A key is a dotted path (`model.kda.g_min`) or any unambiguous suffix
    (`g_min`, `kda.g_min`, `lr`). Unknown or ambiguous keys and unparsable values raise ConfigError."""
    leaves = list(_leaves(cfg))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.lr=1e-3 or model.d_model=256)")
        key, value = item.split("=", 1)
        key = key.strip()
        hits = [leaf for leaf in leaves if leaf[0] == key or leaf[0].endswith("." + key)]
        if not hits:
            close = [k for k, *_ in leaves if key.split(".")[-1] in k]
            hint = f"; did you mean one of {close[:6]}?" if close else "; run `python -m moe_book.train --show-config` for all keys"
            raise ConfigError(f"unknown config key {key!r}{hint}")
        if len(hits) > 1:
            raise ConfigError(f"config key {key!r} is ambiguous: {[h[0] for h in hits]}; use the full dotted path")
        path, owner, name, typ = hits[0]
        setattr(owner, name, _parse(value.strip(), typ, path))
    validate(cfg)
    return cfg


def _check(ok: bool, msg: str):
    if not ok:
        raise ConfigError(msg)


def validate(cfg: Config) -> Config:
    "Reject values the model or trainer cannot run with, naming the key and the fix."
    m, t = cfg.model, cfg.train
    for name, val in [("model.vocab_size", m.vocab_size), ("model.d_model", m.d_model), ("model.n_layers", m.n_layers),
                      ("model.n_heads", m.n_heads), ("model.head_dim", m.head_dim), ("model.d_ff", m.d_ff),
                      ("model.max_seq_len", m.max_seq_len), ("model.global_every", m.global_every),
                      ("train.batch_size", t.batch_size), ("train.seq_len", t.seq_len)]:
        _check(val > 0, f"{name}={val}: must be a positive integer")
    _check(m.vocab_size <= 2**32, f"model.vocab_size={m.vocab_size}: shards store uint32 tokens at most")
    _check(m.mixer in MIXER_TYPES, f"model.mixer={m.mixer!r}: choose one of {MIXER_TYPES}")
    _check(m.global_mixer in MIXER_TYPES, f"model.global_mixer={m.global_mixer!r}: choose one of {MIXER_TYPES}")
    _check(m.ffn in FFN_TYPES, f"model.ffn={m.ffn!r}: choose one of {FFN_TYPES}")
    _check(m.residual in RESIDUAL_TYPES, f"model.residual={m.residual!r}: choose one of {RESIDUAL_TYPES}")
    _check(0 <= m.first_dense <= m.n_layers, f"model.first_dense={m.first_dense}: must be in [0, n_layers={m.n_layers}]")
    _check(m.attnres_block > 0, f"model.attnres_block={m.attnres_block}: must be a positive number of layers")
    _check(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim}: RoPE needs an even head_dim")
    k = m.kda
    _check(k.gate in ("bounded", "softplus"), f"model.kda.gate={k.gate!r}: choose 'bounded' or 'softplus'")
    _check(-6.0 <= k.g_min <= -3.0,
           f"model.kda.g_min={k.g_min}: must lie in [-6, -3] (the bound keeps exp(g_i - g_j) inside bf16 range "
           f"over a 16-token tile while still allowing fast forgetting)")
    _check(k.backend in ("auto", "torch", "triton"), f"model.kda.backend={k.backend!r}: choose auto, torch or triton")
    _check(k.chunk_size in (16, 32, 64, 128), f"model.kda.chunk_size={k.chunk_size}: choose 16, 32, 64 or 128")
    a = m.mla
    _check(a.gate in ("none", "head", "channel"), f"model.mla.gate={a.gate!r}: choose none, head or channel")
    _check(a.qk_rope % 2 == 0, f"model.mla.qk_rope={a.qk_rope}: RoPE needs an even size")
    e = m.moe
    _check(e.n_experts > 0, f"model.moe.n_experts={e.n_experts}: must be positive")
    _check(0 < e.top_k <= e.n_experts,
           f"model.moe.top_k={e.top_k}: must be in [1, n_experts={e.n_experts}]; lower top_k or add experts")
    _check(0 <= e.latent_dim <= m.d_model,
           f"model.moe.latent_dim={e.latent_dim}: must be in [0, d_model={m.d_model}] (0 turns the latent projection off)")
    _check(e.act in ("situ", "swiglu"), f"model.moe.act={e.act!r}: choose 'situ' or 'swiglu'")
    _check(t.seq_len <= m.max_seq_len, f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise max_seq_len")
    _check(t.tokens >= 0 and t.steps >= 0 and (t.tokens > 0 or t.steps > 0),
           "train.tokens and train.steps are both 0: give a token budget (train.tokens=...) or a step count (train.steps=...)")
    _check(t.lr > 0 and 0 <= t.min_lr_ratio <= 1, f"train.lr={t.lr}, train.min_lr_ratio={t.min_lr_ratio}: need lr > 0 and 0 <= min_lr_ratio <= 1")
    _check(t.device in ("auto", "cpu", "cuda"), f"train.device={t.device!r}: choose auto, cpu or cuda")
    _check(t.live in ("auto", "on", "off"), f"train.live={t.live!r}: choose auto, on or off")
    _check(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip}: must be >= 0 (0 turns clipping off)")
    _check(cfg.data.heldout_percent > 0 and cfg.data.heldout_percent < 50,
           f"data.heldout_percent={cfg.data.heldout_percent}: must be in (0, 50)")
    return cfg


def get_config(preset: str = "tiny", overrides=()) -> Config:
    "A preset with overrides applied and validated."
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}: choose one of {sorted(PRESETS)}")
    return apply_overrides(PRESETS[preset](), list(overrides))


def total_steps(cfg: Config) -> int:
    "Optimizer steps the budget buys: a token budget wins over a step count."
    t = cfg.train
    return max(1, t.tokens // (t.batch_size * t.seq_len)) if t.tokens else t.steps
