"""`VllmEngine`: the `Engine` contract on vLLM's offline `LLM` (`sampling.engine: vllm`), for the GPU engine users
already run; tested on vLLM's CPU build (`make test-vllm`). Imported only where a run chooses vLLM: the project's
own environment has no vLLM.

How the contract maps onto vLLM 0.32 (the `models.engine` docstring's plan, and where it had to give):

* weights: vLLM loads the model's architecture from a directory holding its config.json alone (`load_format=dummy`:
  random weights, nothing read), then every publication is written into the running model in place by the worker's
  `reload_weights` (Hugging Face names in; vLLM fuses q / k / v and gate / up itself) through `LLM.collective_rpc`, and
  the prefix cache is reset (its blocks were computed by the old weights). The engine is built once per run, as TRL's
  colocate mode and verl do; it runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so it works inside a Ray
  actor or pytest and the weights cross no process boundary.
* generate(requests, until): one vLLM request per `Request` with `max_tokens = min(until, max_new_tokens) -
  len(tokens)` (and within a multi-turn request's turn budget) and the run's stop ids.
* a process that builds a second engine (a warm Ray worker's next run): vLLM keeps its distributed groups in module
  globals and builds its world group from torch's default group, which the earlier run's device group has replaced
  since; `_leave_an_earlier_world` leaves both first.
* keyed sampling, per token as ours: `KeyedSampler`, a vLLM logits processor, draws each request's next token from
  vLLM's logits with our uniform keyed by (seed, step, prompt, sample, token index) and `sample_tokens` (temperature,
  top-p), records the token and its log-prob (under the temperature, before top-p: what the trainer recomputes), and
  leaves vLLM only that token to sample. vLLM's own sampler and per-request seeds then decide nothing, so a request's
  tokens do not depend on its batch, on the engine, or on a pause / migration, and are our engine's wherever vLLM's
  logits round as ours do (tested on a tiny model; a uniform within fp32 rounding of a CDF boundary could flip one).
  The processor hands its draws to `generate` through this module (`_DRAWS`): the engine core runs in this process.
  The batch's rows are drawn together, in float64 on the CPU (on a GPU: one copy of the batch's logits to the host per
  step, not measured yet); on this machine that costs vLLM nothing measurable (BENCHMARKS.md).
* pause / export: a request stops at `until` by its max_tokens, so nothing runs in vLLM between calls and there is
  nothing to abort; its tokens and log-probs so far are kept here, `export` hands them over.
* continue (import, or resume on this engine): prompt + tokens re-prefilled as a new prompt (vLLM's prefix cache makes
  it cheap on the engine that paused it); the keyed draws continue at the request's token index.
* sleep / wake (colocated policies hand the trainer the memory): `sleep` / `wake` call vLLM's sleep mode where the
  engine was built with it (a GPU); vLLM's CPU worker ignores sleep mode, so on CPU both are no-ops (tested: the
  engine keeps generating).
"""

import itertools
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dovetail.models.engine import (
    Key,
    RePrefillingEngine,
    Request,
    SamplingParams,
    is_finished,
    key_states,
    sample_tokens,
    uniforms_of,
)


def quiet_vllm() -> None:
    """vLLM's own log at ERROR unless the user's environment sets `VLLM_LOGGING_LEVEL` (INFO shows it all): at its
    default it printed ~50 lines for a 3-step run, among them a traceback of a chat-template warm-up that cannot apply
    (we hand vLLM token ids, no tokenizer) and "RotaryEmbedding: Failed to load weights" at every publication (the
    rotary tables are computed, not loaded) — harmless, and alarming to read. Its deprecation warnings go too."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")


DEFAULT_KV_CACHE_BYTES = 1 << 30
"""The KV cache vLLM reserves on CPU (its `gpu_memory_utilization` would reserve a fraction of the host's memory)."""
GPU_MEMORY_UTILIZATION = 0.5
"""The share of a GPU vLLM takes for its weights and KV cache (the trainer holds the rest)."""


def _leave_an_earlier_world() -> None:
    """Where an earlier engine in this process left vLLM's world group over a default group of another size (the
    run's device group, which a warm worker joined after building its last engine), leave both, so that this engine's
    world is this process alone again, as a fresh worker's is. vLLM's groups were cut from the default group the
    device group replaced, and went with it: they are forgotten, not destroyed again. The device group is the earlier
    run's (a run joins its own after building its engines). Otherwise vLLM refuses with "world group already
    initialized with a different world size"."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    world = parallel_state._WORLD
    if world is None or not dist.is_initialized() or world.world_size == dist.get_world_size():
        return
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, parallel_state.GroupCoordinator):
            setattr(parallel_state, name, None)
    dist.destroy_process_group()


class VllmEngine(RePrefillingEngine):
    """Rollouts on vLLM's offline `LLM`, built once for a transformers config (see the module docstring)."""

    def __init__(
        self,
        config,
        params: SamplingParams,
        *,
        max_len: int,
        max_batch: int = 64,
        device: str | torch.device = "cpu",
        stop: Callable[[list[int]], bool] | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    ):
        # Before vLLM reads it: the engine core in this process, where `KeyedSampler` hands its draws to `generate`.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        quiet_vllm()
        _leave_an_earlier_world()
        from vllm import LLM

        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        on_gpu = torch.device(device).type == "cuda"
        if not on_gpu and head_dim < 32:
            raise ValueError(f"vLLM's CPU attention needs a head_dim of 32 or more; this model's is {head_dim}")
        self.params = params
        self.max_len = max_len
        self.stop = stop
        self.paused: dict[Key, Request] = {}
        self.prefill_tokens = 0
        # vLLM reads the architecture from a directory: the config alone, the weights come by `load_weights`.
        self._directory = tempfile.TemporaryDirectory(prefix="dovetail-vllm-")
        config.save_pretrained(self._directory.name)
        pool: dict[str, float] = {"kv_cache_memory_bytes": kv_cache_bytes}
        if on_gpu:
            pool = {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION}
        self.llm = LLM(
            model=self._directory.name,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_len,
            max_num_seqs=max_batch,
            seed=params.seed,
            logits_processors=[keyed_sampler_class()],
            enable_prefix_caching=True,
            enable_sleep_mode=on_gpu,
            **pool,
        )
        self.sleeping = False
        self.on_gpu = on_gpu
        self.weights_bytes = 0
        """What the last `load_weights` wrote into vLLM's model (fp32)."""
        self.pool_bytes = (
            int(GPU_MEMORY_UTILIZATION * torch.cuda.get_device_properties(torch.device(device)).total_memory)
            if on_gpu
            else kv_cache_bytes
        )
        """What vLLM holds besides on CPU (its KV cache), or in all on a GPU (its share of the GPU: weights and KV
        cache)."""

    def load_weights(self, state_dict: dict) -> None:
        """Write the trainer's tensors (Hugging Face names) into vLLM's running model, in place (awake: a sleeping
        engine's weights are offloaded)."""
        if self.sleeping:
            self.wake()
        weights = [(name, torch.as_tensor(t).detach().to(torch.float32)) for name, t in state_dict.items()]
        self.weights_bytes = sum(t.numel() * t.element_size() for _, t in weights)
        # The worker's `reload_weights`: the model's layers were repacked for the device after the first load, so
        # their own `load_weights` no longer applies; this restores the checkpoint layout, loads, and repacks.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()  # cached blocks hold the old weights' keys and values

    def held_bytes(self) -> int:
        """A GPU's share that vLLM took (weights and KV cache within it); on CPU its KV cache and the weights."""
        return self.pool_bytes if self.on_gpu else self.pool_bytes + self.weights_bytes

    def _decode_until(self, requests: list[Request], limit: int) -> None:
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        if self.sleeping:  # a policy that generates without switching the device back first
            self.wake()

        states = key_states(self.params.seed, [r.key for r in requests]).tolist()
        prompts = [TokensPrompt(prompt_token_ids=r.prompt + r.tokens) for r in requests]
        draws = [_DRAWS.setdefault(next(_REQUEST_IDS), {}) for _ in requests]
        ids = list(_DRAWS)[-len(requests) :]
        sampling = [
            VllmSampling(
                n=1,
                temperature=1.0,  # the keyed sampler has chosen the token: every other logit is -inf
                max_tokens=self._turn_tokens(r, limit),
                stop_token_ids=list(self.params.stop_ids),
                ignore_eos=True,  # the stop ids are the run's, given above
                seed=self.params.seed,
                detokenize=False,
                extra_args={KEYED: [state, len(r.tokens), self.params.temperature, self.params.top_p, draw_id]},
            )
            for r, state, draw_id in zip(requests, states, ids)
        ]
        self.prefill_tokens += sum(len(p["prompt_token_ids"]) for p in prompts)
        try:
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        finally:
            for draw_id in ids:
                _DRAWS.pop(draw_id)
        for request, output, drawn in zip(requests, outputs, draws):
            self._record(request, output.outputs[0].token_ids, drawn, limit)

    def _turn_tokens(self, request: Request, limit: int) -> int:
        """The most tokens vLLM may draw for `request`: up to `limit`, and within a multi-turn request's turn budget
        (`max_turn_tokens`), so that a turn waiting on its environment is not decoded past its end. A turn's stop
        strings are ours (`stop`, which vLLM without a tokenizer cannot read): what follows one is dropped."""
        room = limit - len(request.tokens)
        if self.params.max_turn_tokens is None:
            return room
        return min(room, self.params.max_turn_tokens - (len(request.tokens) - request.turn_start))

    def _record(self, request: Request, token_ids, drawn: dict[int, tuple[int, float]], limit: int) -> None:
        """Append vLLM's tokens and the keyed sampler's log-probs of them; the request ends at a stop id, the budget,
        or `stop`."""
        for token in token_ids:
            chosen, log_prob = drawn[len(request.tokens)]
            assert chosen == token, f"vLLM returned {token} where the keyed sampler chose {chosen}"
            request.tokens.append(int(token))
            request.log_probs.append(log_prob)
            if is_finished(request, self.params, self.stop):
                request.finished = True  # vLLM decoded past a stop string: those tokens are dropped
                return
            if len(request.tokens) >= limit:
                return

    def sleep(self) -> None:
        """Free the engine's memory for the trainer (vLLM's sleep level 1: weights offloaded, KV cache dropped); a
        no-op on CPU, whose vLLM worker has no sleep mode."""
        if self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
            self.llm.sleep(level=1)
        self.sleeping = True

    def wake(self) -> None:
        if self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
            self.llm.wake_up()
        self.sleeping = False

    def close(self) -> None:
        self._directory.cleanup()


KEYED = "dovetail_keyed"
"""`SamplingParams.extra_args` key of a request's keyed draws: [key state, tokens it already has, temperature, top_p,
its id in `_DRAWS`] (plain values: vLLM copies the sampling parameters on their way to the engine core)."""

_DRAWS: dict[int, dict[int, tuple[int, float]]] = {}
"""The keyed sampler's (token, log-prob) by token index, of each request `generate` has in flight: the engine core
runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so its logits processor writes here and `generate` reads."""
_REQUEST_IDS = itertools.count()


@dataclass(frozen=True)
class _Keyed:
    """One request's keyed draws: its key state, the tokens it had when submitted, and its id in `_DRAWS`."""

    state: int
    offset: int
    temperature: float
    top_p: float
    draw_id: int

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """vLLM's adapter wants a per-request callable (its signature says what to bind); `KeyedSampler.apply` draws
        the batch's rows together instead of calling this."""
        raise NotImplementedError("KeyedSampler.apply draws every row")


def keyed_sampler_class():
    """vLLM's logits processor that draws each request's token as our engine does (`sample_tokens` with the uniform
    `uniforms_of(key state, token index)`) from vLLM's logits, records (token, log-prob) by token index in the
    request's `_DRAWS` entry, and leaves vLLM only that token (every other logit -inf), so vLLM's sampler, whatever its
    seed, returns it. The batch's rows of one temperature and top-p are drawn in one `sample_tokens` call. Built on
    first use: the class derives from vLLM's, which the project's environment lacks."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class KeyedSampler(AdapterLogitsProcessor):
        """vLLM's adapter keeps, per batch row, `partial(keyed, output_ids)` (its `_new_state`), the output list
        by reference; `apply` reads them all and draws the rows together."""

        def is_argmax_invariant(self) -> bool:
            return False  # it replaces the distribution (greedy requests too)

        def new_req_logits_processor(self, params):
            keyed = (params.extra_args or {}).get(KEYED)
            return None if keyed is None else _Keyed(*keyed)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            groups: dict[tuple[float, float], list[tuple[int, _Keyed, int]]] = {}
            for row, state in self.req_info.items():
                keyed, output_ids = state.func, state.args[0]
                groups.setdefault((keyed.temperature, keyed.top_p), []).append(
                    (row, keyed, keyed.offset + len(output_ids))
                )
            for (temperature, top_p), members in groups.items():
                rows = torch.tensor([row for row, _, _ in members], device=logits.device)
                states = torch.tensor([keyed.state for _, keyed, _ in members], dtype=torch.int64)
                indices = torch.tensor([index for _, _, index in members], dtype=torch.int64)
                tokens, log_probs = sample_tokens(
                    logits[rows].float().cpu(), uniforms_of(states, indices), temperature, top_p
                )
                for (_, keyed, index), token, log_prob in zip(members, tokens.tolist(), log_probs.tolist()):
                    _DRAWS[keyed.draw_id][index] = (token, log_prob)  # by index: a preempted request redraws it
                logits[rows] = -float("inf")
                logits[rows, tokens.to(logits.device)] = 0.0
            return logits

    return KeyedSampler
