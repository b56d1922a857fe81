"""A compact GPT-2 (nanoGPT-style) for the FP8 training example.

Token + position embeddings, pre-LayerNorm blocks, causal self-attention through
F.scaled_dot_product_attention, a 4x MLP with tanh-GELU, and an lm_head tied to the token
embedding; weights initialised as GPT-2 does. Every projection is a plain `nn.Linear` with a bias,
because those are what `fp8ops.convert_to_fp8_training` swaps. The tied `lm_head` is kept a plain
`nn.Linear` (`LM_HEAD_FILTER`), as torchtitan keeps its output layer out of FP8: the logits feed the
loss directly, and in FP8 the gradients read ~11 dB further from BF16's for +2-4 % tokens/s
(benchmarks/RESULTS.md §5, `bench_train.py`'s `fp8ops_lmhead` variants). fp8ops converts a layer in
place, so converting it would keep it tied; Transformer Engine's `te.Linear` would untie it (see
`fp8ops.training`).

arch="llama" swaps in Llama-style blocks: RMSNorm instead of LayerNorm, a SwiGLU MLP (one
gate-and-up projection to 2 x ~8/3 d, then silu(gate) * up) and no biases; positions stay
learned (no RoPE), which leaves the linears' shapes, what FP8 is about, as Llama's.

    from gpt2 import GPT, GPTConfig
    model = GPT(GPTConfig.preset("tiny"))
    logits, loss = model(idx, targets)
"""

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# Presets: "tiny" is for CPU smoke tests; "small" is GPT-2 124M; "1b" is a GPT-2-style 1B model
# wide enough (d2048) for FP8 GEMMs to pay. vocab 256 = the example's byte-level tokenizer.
PRESETS = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=128, block_size=128),
    "small": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "1b": dict(n_layer=16, n_head=16, n_embd=2048, block_size=2048),
    "llama1b": dict(n_layer=16, n_head=16, n_embd=2048, block_size=2048, arch="llama"),
}
ARCHS = ("gpt2", "llama")


@dataclasses.dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 256
    dropout: float = 0.0
    arch: str = "gpt2"  # or "llama": RMSNorm, SwiGLU, no biases (see the module's docstring)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, found {self.arch!r}")
        if self.n_head < 1 or self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}); "
                             "pass --n_embd and --n_head that divide")

    @classmethod
    def preset(cls, name, **overrides):
        """The named preset, with any non-None keyword overriding it."""
        fields = dict(PRESETS[name])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)


def cross_entropy_loss(logits, targets):
    """The model's loss: mean cross-entropy over every position, in FP32 (the logits may be
    BF16 under autocast). A function of its own so that a harness can compile it apart from
    the model, as torchtitan compiles its loss (benchmarks/bench_train.py)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))


def LM_HEAD_FILTER(module, fqn):
    """module_filter_fn for FP8 conversion: everything except the tied lm_head."""
    return fqn.split(".")[-1] != "lm_head"


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        bias = cfg.arch == "gpt2"
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=True)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=True)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class SiluAndMul(nn.Module):
    """silu(gate) * up of x's two halves. A module of its own so that fp8ops.convert can
    fuse it into c_proj's input cast (it recognises exactly this forward; fp8ops/swiglu.py)."""

    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class SwiGLU(nn.Module):
    """Llama's MLP: c_proj(silu(gate) * up), gate and up from one projection; the hidden
    width ~8/3 d rounded up to a multiple of 256, as Llama's."""

    def __init__(self, cfg):
        super().__init__()
        hidden = -(-8 * cfg.n_embd // 3 // 256) * 256
        self.c_fc = nn.Linear(cfg.n_embd, 2 * hidden, bias=False)
        self.act = SiluAndMul()
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.c_proj(self.act(self.c_fc(x))))


def _norm(cfg):
    return nn.LayerNorm(cfg.n_embd) if cfg.arch == "gpt2" else nn.RMSNorm(cfg.n_embd, eps=1e-5)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = _norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = _norm(cfg)
        self.mlp = MLP(cfg) if cfg.arch == "gpt2" else SwiGLU(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=_norm(cfg),
        ))
        # GPT-2's output layer has no bias and shares its weight with the token embedding.
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer): two per block add to the
        # residual stream, so its variance stays put as depth grows.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        """Parameter count, shared lm_head/wte counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = cross_entropy_loss(logits, targets)
        return logits, loss
