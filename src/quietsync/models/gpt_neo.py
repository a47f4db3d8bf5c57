"""GPT-Neo in plain torch: the model the presets build, without importing transformers.

The papers' architecture is Hugging Face's ``GPTNeoForCausalLM`` (learned positions, pre-norm blocks of global
causal self-attention without the ``1/sqrt(d)`` scale and a ``gelu_new`` MLP, a final norm, an output layer tied
to the input embedding). Importing transformers to build it costs a fresh process ~4 CPU-seconds (its lazy
module index reads every model file's ``__all__``) before any work: every local worker, every torchrun worker,
every replica group that comes back after a failure pays it. This module is the same network as that class, for
the configurations the presets use (global attention, no dropout, tied embeddings):

* the same modules under the same names (``transformer.wte``, ``transformer.h.0.attn.attention.q_proj``, ...) in
  the same order, so ``parameters()``, ``state_dict()`` and the checkpoints are those of the transformers class;
* the same initialisation drawn from the same random stream (each module's own reset, then ``normal(0, 0.02)``
  for linear and embedding weights, zero biases, unit norms, in the order transformers' ``post_init`` visits
  them), so a seed gives the same parameters bit for bit;
* the same arithmetic (attention scores in fp32, the causal mask as a ``where`` with the dtype's minimum, the tanh
  GELU, the loss over labels padded by one and shifted), so the same parameters give the same logits, loss and
  gradients bit for bit.

``tests/models/test_gpt_neo.py`` checks all three against transformers' class. :meth:`GPTNeo.to_transformers`
gives that class back (for ``save_pretrained``: the exported folder is a transformers GPT-Neo folder).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""Label of a position the loss skips (transformers' convention; the last position of every row)."""


@dataclass(frozen=True)
class GPTNeoConfig:
    """The shape of a GPT-Neo model (the fields transformers' ``GPTNeoConfig`` calls the same)."""

    vocab_size: int
    """Tokens of the input and output embedding."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Attention heads per block (must divide ``hidden_size``)."""
    max_position_embeddings: int
    """Longest sequence the learned position embedding covers."""
    intermediate_size: int | None = None
    """Width of each block's MLP (None: ``4 * hidden_size``)."""
    layer_norm_epsilon: float = 1e-5
    """The norms' epsilon."""
    initializer_range: float = 0.02
    """Standard deviation of the initial linear and embedding weights."""
    eos_token_id: int = 0
    """End-of-sequence token (also the begin and padding token of the exported config)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads must divide hidden_size, got {self.num_heads} and {self.hidden_size}")

    @property
    def inner_size(self) -> int:
        return self.intermediate_size if self.intermediate_size is not None else 4 * self.hidden_size

    def transformers_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of transformers' ``GPTNeoConfig`` describing this model."""
        return dict(
            vocab_size=self.vocab_size, max_position_embeddings=self.max_position_embeddings,
            hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
            attention_types=[[["global"], self.num_layers]], intermediate_size=self.inner_size,
            window_size=self.max_position_embeddings, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
            layer_norm_epsilon=self.layer_norm_epsilon, initializer_range=self.initializer_range,
            bos_token_id=self.eos_token_id, eos_token_id=self.eos_token_id, pad_token_id=self.eos_token_id,
            tie_word_embeddings=True, use_cache=False)


@dataclass
class CausalLMOutput:
    """What a forward returns: the loss (None without labels) and the logits, read as transformers' outputs are:
    ``out.loss``, ``out["loss"]``, or ``out[0]`` (the first of loss and logits that is not None)."""

    loss: torch.Tensor | None
    logits: torch.Tensor

    def __getitem__(self, key: str | int) -> torch.Tensor | None:
        if isinstance(key, int):
            return tuple(v for v in (self.loss, self.logits) if v is not None)[key]
        if key not in ("loss", "logits"):
            raise KeyError(key)
        return getattr(self, key)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the next label (labels padded by one ignored
    position and shifted left; fp32 logits): transformers' ``ForCausalLMLoss``."""
    logits = logits.float()
    shifted = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    return nn.functional.cross_entropy(logits.view(-1, vocab_size), shifted.view(-1).to(logits.device),
                                       ignore_index=IGNORE_INDEX)


class SelfAttention(nn.Module):
    """Global causal self-attention; the scores in fp32, not scaled (GPT-Neo's choice), masked with the dtype's
    minimum."""

    def __init__(self, config: GPTNeoConfig) -> None:
        super().__init__()
        n = config.max_position_embeddings
        # not persistent: state_dict() and the checkpoints stay those of the transformers class
        self.register_buffer("bias", torch.tril(torch.ones((n, n), dtype=torch.bool)).view(1, 1, n, n),
                             persistent=False)
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        width = config.hidden_size
        # registered in transformers' order: k, v, q, out (the order of the initial draws and of parameters())
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.q_proj = nn.Linear(width, width, bias=False)
        self.out_proj = nn.Linear(width, width, bias=True)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        query, key, value = self._heads(self.q_proj(hidden)), self._heads(self.k_proj(hidden)), \
            self._heads(self.v_proj(hidden))
        scores = torch.matmul(query.to(torch.float32), key.to(torch.float32).transpose(-1, -2))
        length = query.shape[-2]
        floor = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
        scores = torch.where(self.bias[:, :, :length, :length], scores, floor)
        weights = nn.functional.softmax(scores, dim=-1).to(value.dtype)
        out = torch.matmul(weights, value).permute(0, 2, 1, 3).contiguous()
        return self.out_proj(out.view(*out.shape[:-2], -1))


class Attention(nn.Module):
    """The attention sub-module as transformers nests it (``attn.attention``)."""

    def __init__(self, config: GPTNeoConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.attention(hidden)


class MLP(nn.Module):
    """``c_proj(gelu_new(c_fc(x)))``, the tanh approximation of GELU written as transformers writes it."""

    def __init__(self, config: GPTNeoConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.inner_size)
        self.c_proj = nn.Linear(config.inner_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)
        x = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        return self.c_proj(x)


class Block(nn.Module):
    """A pre-norm transformer block. ``gradient_checkpointing`` (set by
    :meth:`GPTNeo.activation_checkpointing_enable`) recomputes its activations in backward; ``forward`` is what is
    checkpointed, not ``__call__``, so module hooks (FSDP2's) stay outside the recomputation."""

    gradient_checkpointing = False

    def __init__(self, config: GPTNeoConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)
        self._checkpoint_kwargs: dict[str, Any] = {"use_reentrant": False}

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.attn(self.ln_1(hidden)) + hidden
        return hidden + self.mlp(self.ln_2(hidden))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        # only when a backward follows: eval and no_grad calls have nothing to recompute
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return (checkpoint(self._forward, hidden, **self._checkpoint_kwargs),)
        return (self._forward(hidden),)  # a 1-tuple, as transformers' block returns


class Body(nn.Module):
    """Embeddings, blocks and the final norm (``transformer``)."""

    def __init__(self, config: GPTNeoConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden = block(hidden)[0]
        return self.ln_f(hidden)


def _init(module: nn.Module, std: float) -> None:
    """transformers' initialisation of one module (its ``_init_weights``)."""
    with torch.no_grad():
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()


def _post_order(module: nn.Module) -> list[nn.Module]:
    """Children before their parent, in registration order: the order transformers' ``post_init`` visits modules."""
    return [m for child in module.children() for m in _post_order(child)] + [module]


class GPTNeo(nn.Module):
    """GPT-Neo with its language-model head (``transformer`` + ``lm_head``, tied to ``transformer.wte``).

    ``model(input_ids=ids, labels=ids)`` returns a :class:`CausalLMOutput` whose ``loss`` is the mean next-token
    cross-entropy, as transformers' class does. Built from ``config`` with transformers' initialisation (see the
    module's docstring)."""

    supports_gradient_checkpointing = True

    def __init__(self, config: GPTNeoConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = Body(config)
        # transformers initialises the body (post-order) before it builds the head; the head's draws come after
        for module in _post_order(self.transformer):
            _init(module, config.initializer_range)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _init(self.lm_head, config.initializer_range)
        # tied: the head's own draw above is discarded; it keeps the random stream in step with transformers
        self.lm_head.weight = self.transformer.wte.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    @staticmethod
    def loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **_: Any) -> torch.Tensor:
        """:func:`causal_lm_loss` (the name transformers' models give it; Cyclic DP's last stage calls it)."""
        return causal_lm_loss(logits, labels, vocab_size)

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
        if input_ids is None:
            raise TypeError("GPTNeo takes input_ids")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("GPTNeo takes full sequences: attention_mask must be all ones (no padding)")
        if input_ids.shape[-1] > self.config.max_position_embeddings:
            raise ValueError(f"input_ids: sequences of at most {self.config.max_position_embeddings} tokens, got "
                             f"{input_ids.shape[-1]}")
        logits = self.lm_head(self.transformer(input_ids))
        loss = None if labels is None else causal_lm_loss(logits, labels, self.config.vocab_size)
        return CausalLMOutput(loss=loss, logits=logits)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each block's activations in backward (``torch.utils.checkpoint``, non-reentrant unless
        ``activation_checkpointing_kwargs`` says otherwise)."""
        kwargs = dict(activation_checkpointing_kwargs or {"use_reentrant": False})
        for block in self.transformer.h:
            block.gradient_checkpointing = True
            block._checkpoint_kwargs = kwargs

    def to_transformers(self) -> nn.Module:
        """transformers' ``GPTNeoForCausalLM`` holding a copy of this model's parameters (for ``save_pretrained``)."""
        from transformers import GPTNeoConfig as HFConfig
        from transformers import GPTNeoForCausalLM

        hf = GPTNeoForCausalLM(HFConfig(**self.config.transformers_kwargs()))
        hf.load_state_dict({k: v.detach().to("cpu") for k, v in self.state_dict().items()})
        return hf.train(self.training)


__all__ = ["GPTNeo", "GPTNeoConfig", "CausalLMOutput", "causal_lm_loss"]
