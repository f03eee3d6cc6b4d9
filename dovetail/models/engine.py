"""Language-model generation for GRPO rollouts: the `Engine` interface and our own `TorchEngine`.

A rollout device keeps an engine and asks it to decode requests. The runtime needs three things of it
beyond plain generation: to stop a request part-way (`generate(..., until=k)` leaves it paused), to hand
a paused request to another device (`export`), and to continue it there token for token (pass the
exported `Request` to `generate` on the other engine, which re-prefills prompt + tokens). That is why
every token is drawn from a uniform keyed by (seed, step, prompt, sample, token index) rather than by a
generator that lives in the engine: a sequence's tokens do not depend on its batch position, its
neighbours, the device, or where it was migrated.

How a GPU serving engine maps onto `Engine` (vLLM's is `models.vllm_engine.VllmEngine`, `sampling.engine: vllm`; its
docstring says where vLLM 0.32 differs from this plan: no abort is needed, and the keyed sampler records the
log-probs itself):

* vLLM / SGLang `generate(requests, until)`: submit each request with `max_tokens = min(until,
  max_new_tokens) - len(tokens)` and the stop ids; the engines batch continuously themselves.
* `export(key)`: abort the request (vLLM `abort_request`, SGLang `abort_request`) and keep the output
  tokens and log-probs it has produced; the engine frees its KV blocks.
* import: resubmit prompt + tokens as a new prompt with the remaining max_tokens. Prefix caching makes
  the re-prefill cheap when the request comes back to the engine that paused it.
* keyed sampling: a per-request logits processor (vLLM) / custom sampler (SGLang) that draws the token
  at index len(tokens) with `keyed_uniforms` and `sample_tokens` below, so the continuation after an
  import is the same sequence as without the migration; `logprobs=0` (the sampled token's log-prob,
  taken from the temperature-scaled distribution before top-p, which is what the trainer recomputes).
"""

import dataclasses
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, overload

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

Key = tuple[int, int, int]

CACHE = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
"""What a causal LM's forward calls its KV cache, in and out: `cache` since transformers 5.24, `past_key_values`
before (the vLLM environment's transformers is older than the project's)."""


@dataclass(frozen=True)
class SamplingParams:
    """One engine's sampling settings; a tiny top_p (keep only the most likely token) is greedy decoding."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_ids: tuple[int, ...] = ()
    seed: int = 0
    max_turn_tokens: int | None = None
    """A multi-turn rollout's budget of one model turn (`Request.turn_start`); None: the rest of max_new_tokens."""
    multi_turn: bool = False
    """Whether a finished request is a turn its trajectory may follow (an env run's): an engine that can keeps its
    KV cache for the next turn (`TorchEngine`), which then prefills only what the environment appended."""

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1, got {self.max_turn_tokens}")


@dataclass
class Request:
    """One sequence being generated; also what crosses Ray when it moves (plain Python only).

    `key` is (step, prompt, sample), the sample id used everywhere in the repo. log_probs[i] is the
    log-prob of tokens[i] under the sampling temperature (before top-p truncation).

    A multi-turn rollout's request holds its earlier turns and the environment's observations in `tokens` (their
    log-probs 0, never read) and decodes one model turn from `turn_start`: the stop strings and the turn's budget
    read its tokens from there, and `finished` means the turn is done. Every token's draw stays keyed by its index
    in `tokens`, so no two turns of a trajectory share one."""

    key: Key
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finished: bool = False
    turn_start: int = 0

    def copy(self) -> "Request":
        return replace(self, prompt=list(self.prompt), tokens=list(self.tokens), log_probs=list(self.log_probs))


class Engine(ABC):
    """What a rollout device needs of a generation engine; `TorchEngine` is ours, vLLM / SGLang could be
    others (see the module docstring)."""

    params: SamplingParams
    paused: dict[Key, Request]
    """Requests `generate` stopped at `until`, by key, until continued or exported."""

    @abstractmethod
    def load_weights(self, state_dict: dict) -> None:
        """Take the policy's new weights (Hugging Face Llama names); paused caches become stale."""

    @abstractmethod
    def generate(self, requests: list[Request], until: int | None = None) -> list[Request]:
        """Decode every request until it finishes (a stop id or max_new_tokens) or has `until` tokens.

        Returns updated copies in the given order; the unfinished ones are paused and stay exportable.
        A request with tokens that this engine did not pause (an import) is re-prefilled first."""

    @abstractmethod
    def export(self, key: Key) -> Request:
        """Hand over a paused request and free what the engine holds for it."""

    def release(self, key: Key) -> None:
        """Forget what this engine keeps of a trajectory whose episode is done (a multi-turn run's kept cache, see
        `SamplingParams.multi_turn`), so that its slot serves others; by default an engine keeps nothing."""
        return None

    def _keep_paused(self, results: list[Request]) -> list[Request]:
        """`generate`'s end: the unfinished of `results` stay paused (exportable), the finished are forgotten."""
        for request in results:
            if request.finished:
                self.paused.pop(request.key, None)
            else:
                self.paused[request.key] = request.copy()
        return results

    @abstractmethod
    def held_bytes(self) -> int:
        """Bytes the engine holds on its device beside the trainer: its own copy of the weights and its KV cache
        (what a device's `rollout` memory figure reports)."""

    def sleep(self) -> None:
        """Give the device's memory to the trainer while the device trains (a colocated policy's switch); by default
        nothing is freed: our engine's cache is preallocated and small beside the trainer's state here."""
        return None

    def wake(self) -> None:
        """Take the memory back before generating again (`sleep`)."""
        return None


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits: the hash runs on int64 tensors, whose + and * wrap."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX = (_signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """uint64 z >> bits on int64 bits: the arithmetic shift, then the sign copies masked off."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser: a bijection of uint64 that mixes every input bit into every output bit."""
    z = (z ^ _shift_right(z, 30)) * _MIX[0]
    z = (z ^ _shift_right(z, 27)) * _MIX[1]
    return z ^ _shift_right(z, 31)


def _absorb(state: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    return _splitmix64(state ^ _splitmix64(column + _GOLDEN))


def key_states(seed: int, keys: list[Key], device: str | torch.device = "cpu") -> torch.Tensor:
    """The hash state (int64) after absorbing (seed, *key): what `keyed_uniforms` shares between the tokens of
    one request, so a decode step only absorbs the token index."""
    parts = torch.tensor([[seed, *key] for key in keys], dtype=torch.int64, device=device).reshape(len(keys), 4)
    state = torch.full((len(keys),), _GOLDEN, dtype=torch.int64, device=device)
    for column in parts.T:
        state = _absorb(state, column)
    return state


def uniforms_of(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u for the token index `positions` of the requests whose `key_states` are `states`."""
    state = _absorb(states, positions.to(torch.int64))
    # The top 52 bits on a grid offset by half a step: never 0, never 1.
    return _shift_right(state, 12).double() * 2.0**-52 + 2.0**-53


def keyed_uniforms(seed: int, keys: list[Key], positions: list[int]) -> torch.Tensor:
    """u[i] in (0, 1), float64, a pure function of (seed, *keys[i], positions[i]): a counter-based hash,
    so the draw for a token is the same in any batch, on any device, before and after a migration.

    The hash is splitmix64 absorbing seed, step, prompt, sample and position in turn, on uint64 (computed on
    int64 bits, whose wrapping + and * are uint64's)."""
    return uniforms_of(key_states(seed, keys), torch.tensor(positions, dtype=torch.int64))


def sample_tokens(
    logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling of one token per row of `logits` (B, V) with the uniforms `u` (B,), in float64.

    The distribution is softmax(logits / temperature), truncated to the smallest prefix of tokens sorted
    by probability (ties: lower id first) whose mass reaches top_p. Returns the tokens and their
    log-probs before the truncation, which is what the trainer recomputes for the GRPO ratio."""
    log_probs = (logits.double() / temperature).log_softmax(-1)
    sorted_probs, order = log_probs.exp().sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    kept = mass_before < top_p
    cdf = torch.where(kept, sorted_probs, 0.0).cumsum(-1)
    u = u.to(cdf.device, torch.float64)
    index = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    index = torch.minimum(index, kept.sum(-1) - 1)  # u * total can round up to the total
    tokens = order.gather(1, index.unsqueeze(1)).squeeze(1)
    return tokens, log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)


ENGINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""The transformers `model_type`s `LlamaWeights` computes: Llama and Mistral (optional attention and MLP biases),
Qwen2 (q / k / v biases), Qwen3 (RMSNorm of each query and key head before RoPE)."""

STATIC_ROPE = ("default", "linear", "llama3", "yarn")
"""RoPE types whose frequencies do not depend on the sequence's length: transformers' own functions compute them."""


def engine_problem(config, max_len: int) -> str | None:
    """Why `LlamaWeights` cannot compute a model of this transformers config over `max_len` positions (its
    architecture, activation, RoPE or sliding window), or None where it can."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ENGINE_MODEL_TYPES:
        return f"architecture {model_type!r} (the engine computes {', '.join(ENGINE_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (the engine's MLP is SwiGLU)"
    rope = _rope_parameters(config)
    if rope.get("rope_type", "default") not in STATIC_ROPE:
        return f"RoPE {rope.get('rope_type')!r} (the engine computes {', '.join(STATIC_ROPE)})"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    windowed = model_type == "mistral" or "sliding_attention" in layer_types
    if windowed and window is not None and window < max_len:
        return f"a sliding window of {window} positions, below the {max_len} a sequence takes"
    return None


def _rope_parameters(config) -> dict:
    return getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_theta", 10_000.0),
    }


class LlamaWeights:
    """The Llama architecture (RMSNorm, RoPE, GQA, SwiGLU) in fp32 from a `LlamaForCausalLM` state dict, with
    its attention reading and writing a caller-given KV cache; equal to Hugging Face's logits up to fp32
    rounding (tested at 1e-5). Its relatives too (`ENGINE_MODEL_TYPES`): any bias a q / k / v / o, gate / up / down
    projection has, and Qwen3's per-head query and key norms.

    Fewer, larger kernels per layer than HF's modules: q/k/v and gate/up are fused into one matrix each,
    the RMSNorm weights are folded into the matrices they feed, and queries of a GQA group share one
    batched product with their kv head's cache."""

    def __init__(self, config, state_dict: dict, *, max_len: int, device: str | torch.device = "cpu"):
        problem = engine_problem(config, max_len)
        if problem is not None:
            raise ValueError(f"the engine cannot compute {problem}")
        rope = _rope_parameters(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps

        def weight(name: str) -> torch.Tensor:
            return torch.as_tensor(state_dict[name]).detach().to(device, torch.float32).clone()

        def biases(names: list[str], sizes: list[int]) -> torch.Tensor | None:
            """The projections' biases end to end (zeros for one without), or None where none has one."""
            if not any(name in state_dict for name in names):
                return None
            return torch.cat(
                [weight(n) if n in state_dict else torch.zeros(size, device=device) for n, size in zip(names, sizes)]
            )

        self.embed = weight("model.embed_tokens.weight")
        lm_head = weight("lm_head.weight") if "lm_head.weight" in state_dict else self.embed
        # Each RMSNorm's weight is folded into the matrix it feeds: W (w * n) == (W diag(w)) n.
        self.lm_head = lm_head * weight("model.norm.weight")
        self.layers = []
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}."
            attn = [weight(prefix + f"self_attn.{p}_proj.weight") for p in "qkvo"]
            mlp = [weight(prefix + f"mlp.{p}_proj.weight") for p in ("gate", "up", "down")]
            layer = {
                "qkv": torch.cat(attn[:3]) * weight(prefix + "input_layernorm.weight"),
                "qkv_bias": biases([prefix + f"self_attn.{p}_proj.bias" for p in "qkv"], [len(w) for w in attn[:3]]),
                "o": attn[3],
                "o_bias": biases([prefix + "self_attn.o_proj.bias"], [len(attn[3])]),
                "gate_up": torch.cat(mlp[:2]) * weight(prefix + "post_attention_layernorm.weight"),
                "gate_up_bias": biases([prefix + f"mlp.{p}_proj.bias" for p in ("gate", "up")], [len(mlp[0])] * 2),
                "down": mlp[2],
                "down_bias": biases([prefix + "mlp.down_proj.bias"], [len(mlp[2])]),
                "qk_norm": None,
            }
            if prefix + "self_attn.q_norm.weight" in state_dict:  # Qwen3: one norm of each head's queries, keys
                q_norm, k_norm = weight(prefix + "self_attn.q_norm.weight"), weight(prefix + "self_attn.k_norm.weight")
                layer["qk_norm"] = torch.cat([q_norm.expand(self.num_heads, -1), k_norm.expand(self.num_kv_heads, -1)])
            self.layers.append(layer)
        if rope.get("rope_type", "default") == "default":
            half = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(device, torch.float32)
            inv_freq, scaling = 1.0 / (rope["rope_theta"] ** (half / self.head_dim)), 1.0
        else:  # transformers' own frequencies (and attention scaling: YaRN's) of the scaled RoPE types
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, device)
            inv_freq = inv_freq.to(device, torch.float32)
        angles = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None]
        angles = torch.cat([angles, angles], dim=-1)
        # HF's rotate_half(x) * sin == roll(x, half) * sin with the first half's sign flipped (negation is
        # exact): one roll instead of two slices, a negation and a concatenation per rotation.
        self.cos, self.signed_sin = angles.cos() * scaling, angles.sin() * scaling
        self.signed_sin[:, : self.head_dim // 2] *= -1

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor these weights hold (the fused matrices, the rotary tables): what they occupy."""
        layered = [t for layer in self.layers for t in layer.values() if t is not None]
        return [self.embed, self.lm_head, *layered, self.cos, self.signed_sin]

    def forward(
        self, tokens: torch.Tensor, start: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """Final normalised hidden states (B, T, hidden) of `tokens` (B, T) placed at positions start[b] + t.

        The caches are views holding the first start[b] positions of row b: keys [layers, B, kv_heads,
        head_dim, max_len] (stored transposed, so q @ K^T reads a plain slice), values [layers, B, kv_heads,
        max_len, head_dim], each layer's contiguous; this call writes the new positions into them. Query t of
        row b attends to cache positions <= start[b] + t: causal and per-row length mask at once, so rows of
        different lengths decode together, and right padding in a prefill only writes positions that the next
        tokens overwrite before anything reads them."""
        batch, steps = tokens.shape
        positions = start[:, None] + torch.arange(steps, device=tokens.device)
        return self._layers(tokens.reshape(-1), positions, None, k_cache, v_cache).view(batch, steps, -1)

    def decode(
        self, tokens: torch.Tensor, start: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """Logits (B, vocab) of one token per row, tokens[b] at position start[b]: `forward` with T = 1."""
        return self.logits(self._layers(tokens, start[:, None], None, k_cache, v_cache))

    def prefill(
        self,
        sequences: list[list[int]],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        starts: list[int] | None = None,
    ) -> None:
        """Cache the keys and values of sequences[b] at positions starts[b].. (0.. by default) of row b, whose
        cache holds its first starts[b] positions already, as `forward` on the right-padded batch would, without
        its padding or its output: the linear layers see the real tokens only, packed; attention alone runs on the
        (B, longest) grid; the last layer stops at its keys and values. A padding cell's position is held within
        the cache (it writes nothing and nothing reads its query)."""
        device = k_cache.device
        lengths = torch.tensor([len(sequence) for sequence in sequences], device=device)
        width = max(map(len, sequences))
        offsets = torch.arange(width, device=device).expand(len(sequences), width)
        real = offsets < lengths[:, None]
        positions = offsets if starts is None else offsets + torch.tensor(starts, device=device)[:, None]
        positions = positions.clamp(max=k_cache.shape[-1] - 1)
        tokens = torch.tensor([token for sequence in sequences for token in sequence], device=device)
        self._layers(tokens, positions, real, k_cache, v_cache, output=False)

    @overload
    def _layers(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        real: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        output: Literal[True] = True,
    ) -> torch.Tensor: ...

    @overload
    def _layers(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        real: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        output: Literal[False],
    ) -> None: ...

    def _layers(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        real: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        output: bool = True,
    ) -> torch.Tensor | None:
        """The layers on `tokens` (N,), packed row by row: the grid cells of `positions` (B, T) where `real`
        (B, T) holds, or every cell when it is None. Returns the final normalised hidden states (N, hidden),
        or nothing without `output`, which skips what only the output needs (the last layer past its cache).

        Every per-token operation (linear layers, norms, RoPE, cache writes) runs on the N packed tokens;
        attention runs on the grid, as in `forward` on a padded batch."""
        device = tokens.device
        batch, steps = positions.shape
        kv_heads, head_dim, max_len = self.num_kv_heads, self.head_dim, k_cache.shape[-1]
        groups = self.num_heads // kv_heads
        span = int(positions.max()) + 1
        unseen = torch.arange(span, device=device) > positions[..., None]  # (B, T, span)
        # Scores are (B * kv_heads, groups * T, span), row g * T + t: the same mask for every group.
        bias = torch.zeros(unseen.shape, device=device).masked_fill_(unseen, -torch.inf)
        bias = bias[:, None, None].expand(batch, kv_heads, groups, steps, span)
        bias = bias.reshape(batch * kv_heads, groups * steps, span)
        rows = torch.arange(batch, device=device)[:, None].expand(batch, steps)
        token_rows, token_positions = (rows, positions) if real is None else (rows[real], positions[real])
        token_rows, token_positions = token_rows.reshape(-1), token_positions.reshape(-1)
        # Where each token's keys and values go, as offsets into each layer's flattened cache: one index_copy_
        # per layer and tensor. Keys: [row, head, dim, position]; values: rows of head_dim at [row, head, position].
        row_heads = (token_rows * kv_heads)[:, None] + torch.arange(kv_heads, device=device)  # (N, kv_heads)
        v_index = (row_heads * max_len + token_positions[:, None]).reshape(-1)
        k_index = (row_heads[..., None] * head_dim + torch.arange(head_dim, device=device)) * max_len
        k_index = (k_index + token_positions[:, None, None]).reshape(-1)
        cos, sin = self.cos[token_positions][:, None], self.signed_sin[token_positions][:, None]  # (N, 1, head_dim)
        qk_heads, q_size = self.num_heads + kv_heads, self.num_heads * head_dim
        x = self.embed[tokens]
        for index, (layer, layer_k, layer_v) in enumerate(zip(self.layers, k_cache, v_cache)):
            qkv = F.linear(self._normalize(x), layer["qkv"], layer["qkv_bias"])
            qkv = qkv.view(len(tokens), qk_heads + kv_heads, head_dim)
            qk = qkv[:, :qk_heads]
            if layer["qk_norm"] is not None:
                qk = self._normalize(qk) * layer["qk_norm"]
            qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * sin
            layer_k.view(-1).index_copy_(0, k_index, qk[:, self.num_heads :].reshape(-1))
            layer_v.view(-1, head_dim).index_copy_(0, v_index, qkv[:, qk_heads:].reshape(-1, head_dim))
            if not output and index == self.num_layers - 1:
                return None
            q = qk[:, : self.num_heads]
            if real is not None:
                q = q.new_zeros(batch, steps, self.num_heads, head_dim).index_put_((real,), q)
            # Query head h reads kv head h // groups (HF repeat_kv): group the queries, never copy the cache.
            q = q.reshape(batch, steps, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
            q = q.reshape(batch * kv_heads, groups * steps, head_dim)
            keys = layer_k[..., :span].reshape(batch * kv_heads, head_dim, span)
            scores = torch.baddbmm(bias, q, keys, alpha=head_dim**-0.5)
            attended = scores.softmax(-1) @ layer_v[:, :, :span].reshape(batch * kv_heads, span, -1)
            attended = attended.view(batch, kv_heads, groups, steps, head_dim).permute(0, 3, 1, 2, 4)
            attended = attended.reshape(batch, steps, q_size)
            attended = attended.reshape(-1, q_size) if real is None else attended[real]
            x = x + F.linear(attended, layer["o"], layer["o_bias"])
            gate, up = F.linear(self._normalize(x), layer["gate_up"], layer["gate_up_bias"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"], layer["down_bias"])
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight (folded into the next matrix)."""
        return x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)


def is_finished(request: Request, params: SamplingParams, stop: Callable[[list[int]], bool] | None) -> bool:
    """Whether a request just given its latest token is done: a stop id, the token budget, the turn's budget, or
    `stop` on the turn's tokens (a single-turn request's turn is its whole response)."""
    turn = request.tokens[request.turn_start :]
    return (
        request.tokens[-1] in params.stop_ids
        or len(request.tokens) >= params.max_new_tokens
        or (params.max_turn_tokens is not None and len(turn) >= params.max_turn_tokens)
        or (stop is not None and stop(turn))
    )


def token_limit(params: SamplingParams, until: int | None) -> int:
    """The tokens a request may have when `generate(..., until)` returns it."""
    return params.max_new_tokens if until is None else min(until, params.max_new_tokens)


def check_fits(requests: list[Request], params: SamplingParams, max_len: int) -> None:
    for request in requests:
        if not request.prompt or len(request.prompt) + params.max_new_tokens > max_len:
            raise ValueError(
                f"request {request.key}: prompt of {len(request.prompt)} tokens + "
                f"{params.max_new_tokens} new ones must fit in 1..{max_len}"
            )


class TorchEngine(Engine):
    """Batched decoding with a preallocated KV cache and continuous batching, on CPU or one GPU.

    The cache is two preallocated tensors, keys [layers, slots, kv_heads, head_dim, max_len] and values
    [layers, slots, kv_heads, max_len, head_dim]; a slot holds one sequence. The running requests (at
    most `max_batch`) always occupy slots 0..n-1, so a decode step reads the cache as one contiguous
    view: a request that joins is swapped into slot n, one that leaves is swapped with the last running
    one. Each slot's cache holds every token of its sequence but the last, which is the input of the
    next decode step; a newly admitted request is prefilled up to that point, batched with the others
    joining at the same step (identical sequences, a GRPO group's prompt, computed once).

    Swaps are bookkeeping first (`slot_owner`, `cached_len`, a pending permutation of the slots); the cache
    rows move in one gather / scatter per tensor before the next forward reads them, and only the rows
    whose new slot is owned: a finished sequence's rows are never copied.

    Paused requests keep their slot (beyond the running ones), so the next `generate` on this engine
    resumes them without a prefill. When a joining request needs a slot and none is free, the paused
    occupant is evicted and re-prefilled if it comes back: slower, the same tokens.

    A multi-turn run's finished turns (`SamplingParams.multi_turn`) keep their slot too (`kept`): the trajectory's
    next turn, the same prompt and tokens with the environment's observation after them, prefills only the
    observation onto the kept cache, where a re-prefill would compute the whole trajectory again. A kept cache is
    the first to go when a slot is needed (a slot no one owns, then a kept one, then a paused one): while the
    engine has slots to spare, keeping costs nothing; without, the trajectory is re-prefilled as an import is.

    `stop(tokens)`, where given, ends a request whose tokens it says are done (stop strings: it reads only the
    request's own tokens, so a request stops where it would in any batch, on any engine)."""

    def __init__(
        self,
        config,
        params: SamplingParams,
        *,
        max_batch: int = 32,
        num_slots: int | None = None,
        max_len: int | None = None,
        device: str | torch.device = "cpu",
        stop: Callable[[list[int]], bool] | None = None,
    ):
        self.config = config
        self.params = params
        self.stop = stop
        self.max_batch = max_batch
        self.num_slots = num_slots or 2 * max_batch
        if self.num_slots < max_batch:
            raise ValueError(f"num_slots ({self.num_slots}) must be >= max_batch ({max_batch})")
        self.max_len = max_len or config.max_position_embeddings
        self.device = torch.device(device)
        self.weights: LlamaWeights | None = None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        slots = (config.num_hidden_layers, self.num_slots, config.num_key_value_heads)
        self.k_cache = torch.zeros((*slots, head_dim, self.max_len), device=self.device)  # see LlamaWeights.forward
        self.v_cache = torch.zeros((*slots, self.max_len, head_dim), device=self.device)
        self.slot_owner: list[Key | None] = [None] * self.num_slots
        self.cached_len = [0] * self.num_slots  # positions of the slot's sequence held in the cache
        self.paused: dict[Key, Request] = {}
        self.kept: dict[Key, Request] = {}  # finished turns of a multi-turn run whose slot still holds their cache
        self.running: list[Request] = []  # running[i] occupies slot i; empty between generate calls
        self.prefill_tokens = 0  # tokens prefilled so far: shows re-prefills after evictions / imports
        self._source = list(range(self.num_slots))  # slot s's cache rows are in slot _source[s] until _move_rows
        self._key_states: dict[Key, int] = {}  # keyed_uniforms' state after (seed, *key), per request

    @classmethod
    def from_model(cls, model, params: SamplingParams, **kwargs) -> "TorchEngine":
        engine = cls(model.config, params, **kwargs)
        engine.load_weights(model.state_dict())
        return engine

    def load_weights(self, state_dict: dict) -> None:
        self.weights = LlamaWeights(self.config, state_dict, max_len=self.max_len, device=self.device)
        self.slot_owner = [None] * self.num_slots  # caches were computed by the old weights
        self.kept.clear()

    def held_bytes(self) -> int:
        """The fused weights and the preallocated KV cache (both held whatever is running)."""
        held = [self.k_cache, self.v_cache, *(self.weights.tensors() if self.weights is not None else [])]
        return sum(t.numel() * t.element_size() for t in held)

    def export(self, key: Key) -> Request:
        request = self.paused.pop(key)
        if key in self.slot_owner:
            self.slot_owner[self.slot_owner.index(key)] = None
        return request

    def generate(self, requests: list[Request], until: int | None = None) -> list[Request]:
        weights = self.weights
        if weights is None:
            raise RuntimeError("load_weights first")
        limit = token_limit(self.params, until)
        results = [request.copy() for request in requests]
        check_fits(results, self.params, self.max_len)
        waiting = deque(r for r in results if not r.finished and len(r.tokens) < limit)
        keys = [r.key for r in waiting]
        self._key_states = dict(zip(keys, key_states(self.params.seed, keys, self.device).tolist()))
        with torch.inference_mode():
            while waiting or self.running:
                self._admit(waiting, weights)
                self._decode_step(weights)
                self._retire(limit)
            self._move_rows()
        return self._keep_paused(results)

    def _admit(self, waiting: deque, weights: LlamaWeights) -> None:
        """Move waiting requests into the running slots; resumes first, then the new ones, prefilled as
        one batch (by `weights`, the loaded ones) in the contiguous slots after them."""
        joining = [waiting.popleft() for _ in range(min(len(waiting), self.max_batch - len(self.running)))]
        to_prefill: list[Request] = []
        extending: list[Request] = []
        for request in joining:
            if self._is_cached(request):
                self._swap(self.slot_owner.index(request.key), len(self.running))
                self.running.append(request)
            elif self._extends_kept(request):
                extending.append(request)
            else:
                to_prefill.append(request)
        if extending:
            self._extend(extending, weights)
        first = len(self.running)
        for request in to_prefill:
            self._claim_slot(request.key, len(self.running))
            self.running.append(request)
        sequences = [(r.prompt + r.tokens)[:-1] for r in to_prefill]
        for offset, sequence in enumerate(sequences):
            self.cached_len[first + offset] = len(sequence)
        prefilled = range(first, first + len(sequences))
        self._move_rows(skip=prefilled)  # the prefill writes every position of those slots that is read
        if not any(sequences):
            return
        # A GRPO group's samples share their prompt: each distinct sequence is computed once, in the slot of
        # its first occurrence, and the others copy its cache rows.
        first_of: dict[tuple[int, ...], int] = {}
        sources = [first_of.setdefault(tuple(sequence), offset) for offset, sequence in enumerate(sequences)]
        computed = [
            sequence if source == offset else [] for offset, (sequence, source) in enumerate(zip(sequences, sources))
        ]
        rows = slice(first, first + len(sequences))
        weights.prefill(computed, self.k_cache[:, rows], self.v_cache[:, rows])
        copies = [(first + offset, first + source) for offset, source in enumerate(sources) if source != offset]
        if copies:
            slots, sources = torch.tensor(copies, device=self.device).T
            for cache in (self.k_cache, self.v_cache):
                cache.index_copy_(1, slots, cache.index_select(1, sources))
        self.prefill_tokens += sum(map(len, sequences))

    def release(self, key: Key) -> None:
        if self.kept.pop(key, None) is not None and key in self.slot_owner:
            self.slot_owner[self.slot_owner.index(key)] = None

    def _extends_kept(self, request: Request) -> bool:
        """Whether `request` is the next turn of a finished turn whose cache is kept: the same prompt, and the
        turn's tokens first in its own."""
        kept = self.kept.get(request.key)
        return (
            kept is not None
            and request.key in self.slot_owner
            and kept.prompt == request.prompt
            and request.tokens[: len(kept.tokens)] == kept.tokens
        )

    def _extend(self, requests: list[Request], weights: LlamaWeights) -> None:
        """Run `requests` (each the next turn of a kept one) from their kept slots: each slot's cache gains what
        was appended since (an observation), but the last token, which the next decode step feeds, as a new
        request's prefill leaves it."""
        first = len(self.running)
        for request in requests:
            del self.kept[request.key]
            self._swap(self.slot_owner.index(request.key), len(self.running))
            self.running.append(request)
        self._move_rows()  # the kept rows into their running slots, before the prefill writes after them
        starts = self.cached_len[first : len(self.running)]
        appended = [(r.prompt + r.tokens)[start:-1] for r, start in zip(requests, starts)]
        for offset, sequence in enumerate(appended):
            self.cached_len[first + offset] += len(sequence)
        if any(appended):
            rows = slice(first, len(self.running))
            weights.prefill(appended, self.k_cache[:, rows], self.v_cache[:, rows], starts=starts)
            self.prefill_tokens += sum(map(len, appended))

    def _is_cached(self, request: Request) -> bool:
        paused = self.paused.get(request.key)
        return (
            request.key in self.slot_owner
            and paused is not None
            and paused.prompt == request.prompt
            and paused.tokens == request.tokens
        )

    def _claim_slot(self, key: Key, slot: int) -> None:
        """Give `slot` (not running) to `key`: a stale copy of it is dropped; the slot's occupant moves to a
        free slot, else to a kept one (whose cache goes), else is evicted."""
        if key in self.slot_owner:
            self.slot_owner[self.slot_owner.index(key)] = None
        self.kept.pop(key, None)
        if self.slot_owner[slot] is not None and self.slot_owner[slot] not in self.kept:
            later = range(slot + 1, self.num_slots)
            spare = next((s for s in later if self.slot_owner[s] is None), None)
            spare = spare if spare is not None else next((s for s in later if self.slot_owner[s] in self.kept), None)
            if spare is not None:
                self._swap(slot, spare)
        overwritten = self.slot_owner[slot]
        if overwritten is not None:  # a kept cache, or an evicted paused one
            self.kept.pop(overwritten, None)
        self.slot_owner[slot] = key

    def _swap(self, a: int, b: int) -> None:
        """Exchange two slots' sequences; their cache rows follow at the next `_move_rows`."""
        if a == b:
            return
        self._source[a], self._source[b] = self._source[b], self._source[a]
        self.slot_owner[a], self.slot_owner[b] = self.slot_owner[b], self.slot_owner[a]
        self.cached_len[a], self.cached_len[b] = self.cached_len[b], self.cached_len[a]

    def _move_rows(self, skip: range = range(0)) -> None:
        """Carry out the pending swaps for the slots with an owner, except `skip`: one gather and one
        scatter per cache tensor."""
        moves = [
            (slot, source)
            for slot, source in enumerate(self._source)
            if source != slot and self.slot_owner[slot] is not None and slot not in skip
        ]
        self._source = list(range(self.num_slots))
        if moves:
            slots, sources = torch.tensor(moves, device=self.device).T
            for cache in (self.k_cache, self.v_cache):
                cache.index_copy_(1, slots, cache.index_select(1, sources))

    def _decode_step(self, weights: LlamaWeights) -> None:
        """One token for every running request: feed each its last token, sample the next (`weights`: the
        loaded ones)."""
        batch = len(self.running)
        tokens = torch.tensor([(r.tokens or r.prompt)[-1] for r in self.running], device=self.device)
        start = torch.tensor(self.cached_len[:batch], device=self.device)
        logits = weights.decode(tokens, start, self.k_cache[:, :batch], self.v_cache[:, :batch])
        states = torch.tensor([self._key_states[r.key] for r in self.running], device=self.device)
        indices = torch.tensor([len(r.tokens) for r in self.running], device=self.device)
        sampled, log_probs = sample_tokens(
            logits, uniforms_of(states, indices), self.params.temperature, self.params.top_p
        )
        for request, token, log_prob in zip(self.running, sampled.tolist(), log_probs.tolist()):
            request.tokens.append(token)
            request.log_probs.append(log_prob)
            request.finished = is_finished(request, self.params, self.stop)
        for slot in range(batch):
            self.cached_len[slot] += 1

    def _retire(self, limit: int) -> None:
        """Finished requests free their slot, ones at `limit` stay in theirs (paused); either way the last
        running request takes the leaver's slot, so the running ones stay in slots 0..n-1."""
        for slot in reversed(range(len(self.running))):
            request = self.running[slot]
            if request.finished or len(request.tokens) >= limit:
                if request.finished and self.params.multi_turn:
                    self.kept[request.key] = request.copy()
                elif request.finished:
                    self.slot_owner[slot] = None
                self._swap(slot, len(self.running) - 1)
                self.running[slot] = self.running[-1]
                self.running.pop()


class RePrefillingEngine(Engine):
    """An engine that keeps nothing of a paused request but its tokens, so that its continuation re-prefills:
    `TransformersEngine`, and vLLM's (`models.vllm_engine`). The contract's bookkeeping is here — copies, the
    length check, the paused requests and their export — and a subclass only decodes."""

    max_len: int

    def export(self, key: Key) -> Request:
        return self.paused.pop(key)

    def generate(self, requests: list[Request], until: int | None = None) -> list[Request]:
        limit = token_limit(self.params, until)
        results = [request.copy() for request in requests]
        check_fits(results, self.params, self.max_len)
        active = [r for r in results if not r.finished and len(r.tokens) < limit]
        if active:
            self._decode_until(active, limit)
        return self._keep_paused(results)

    @abstractmethod
    def _decode_until(self, requests: list[Request], limit: int) -> None:
        """Draw tokens for `requests` (unfinished, under `limit`), in place, until each finishes or has `limit`."""


class TransformersEngine(RePrefillingEngine):
    """Any transformers causal LM through its own forward and KV cache (what its `generate` runs), for the
    architectures `LlamaWeights` does not compute: slower than `TorchEngine` (no continuous batching, no cache kept
    for paused requests: a continuation re-prefills), the same contract: tokens drawn with the keyed uniforms, so a
    request's tokens are its own whatever its batch, and log-probs as `sample_tokens` takes them.

    Requests of one length (a GRPO group's) decode together, so no padding enters the model; a row that finishes
    early keeps being fed until its batch is done, its further tokens dropped."""

    def __init__(
        self,
        model,
        params: SamplingParams,
        *,
        max_len: int,
        max_batch: int = 32,
        stop: Callable[[list[int]], bool] | None = None,
    ):
        self.model = model.eval().requires_grad_(False)  # its own copy: `load_weights` writes into it
        self.params = params
        self.max_len = max_len
        self.max_batch = max_batch
        self.stop = stop
        self.paused: dict[Key, Request] = {}
        self.prefill_tokens = 0

    def load_weights(self, state_dict: dict) -> None:
        self.model.load_state_dict(state_dict)

    def held_bytes(self) -> int:
        """The model copy's parameters and buffers; its KV cache lives only inside a `generate` call."""
        return sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])

    def _decode_until(self, requests: list[Request], limit: int) -> None:
        by_length: dict[int, list[Request]] = {}
        for request in requests:
            by_length.setdefault(len(request.prompt) + len(request.tokens), []).append(request)
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            for same_length in by_length.values():
                for first in range(0, len(same_length), self.max_batch):
                    self._decode(same_length[first : first + self.max_batch], limit, device)

    def _decode(self, batch: list[Request], limit: int, device: torch.device) -> None:
        inputs = torch.tensor([r.prompt + r.tokens for r in batch], device=device)
        self.prefill_tokens += inputs.numel()
        states = key_states(self.params.seed, [r.key for r in batch], device)
        cache = None
        while True:
            output = self.model(input_ids=inputs, use_cache=True, **{CACHE: cache})
            cache = getattr(output, CACHE)
            indices = torch.tensor([len(r.tokens) for r in batch], device=device)
            sampled, log_probs = sample_tokens(
                output.logits[:, -1], uniforms_of(states, indices), self.params.temperature, self.params.top_p
            )
            for request, token, log_prob in zip(batch, sampled.tolist(), log_probs.tolist()):
                if not request.finished and len(request.tokens) < limit:
                    request.tokens.append(token)
                    request.log_probs.append(log_prob)
                    request.finished = is_finished(request, self.params, self.stop)
            if all(r.finished or len(r.tokens) >= limit for r in batch):
                return
            inputs = sampled[:, None]
