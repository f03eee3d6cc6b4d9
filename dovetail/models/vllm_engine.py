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
  len(tokens)`, `logprobs=0` (the sampled token's log-prob): vLLM's raw log-probs at temperature 1, what the trainer
  computes; at another temperature vLLM's processed ones, after the temperature and top-p (with top_p < 1
  renormalised over the kept tokens, where ours are not).
* pause / export: a request stops at `until` by its max_tokens, so nothing runs in vLLM between calls and there is
  nothing to abort; its tokens and log-probs so far are kept here, `export` hands them over.
* continue (import, or resume on this engine): prompt + tokens re-prefilled as a new prompt (vLLM's prefix cache makes
  it cheap on the engine that paused it). Resume and migration are the same operation, so a request continues with
  the same tokens whichever engine continues it.
* keyed sampling: NOT per token. vLLM 0.32's sampler draws from one `torch.Generator` per request, seeded by
  `SamplingParams.seed` and advanced by each token; a v1 logits processor sees the batch's logits but cannot set which
  uniform the sampler draws. So each continuation is seeded by a hash of (seed, step, prompt, sample, tokens so far):
  a request's tokens do not depend on its batch or the engine that continues it (tested), but a request paused at k
  tokens continues with other draws than one never paused (ours: the same). The ledger stays exact either way: the
  tokens and log-probs recorded are the ones vLLM sampled, and the trainer recomputes the old log-probs
  (`config.lm.engine_matches_trainer`).
* sleep / wake (colocated policies hand the trainer the memory): `sleep` / `wake` call vLLM's sleep mode where the
  engine was built with it (a GPU); vLLM's CPU worker ignores sleep mode, so on CPU both are no-ops (tested: the
  engine keeps generating).
"""

import os
import tempfile
from collections.abc import Callable

import torch

from dovetail.models.engine import Engine, Key, Request, SamplingParams, check_fits, key_states

DEFAULT_KV_CACHE_BYTES = 1 << 30
"""The KV cache vLLM reserves on CPU (its `gpu_memory_utilization` would reserve a fraction of the host's memory)."""


class VllmEngine(Engine):
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
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vLLM reads it: the engine in-process
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
        self.llm = LLM(
            model=self._directory.name,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_len,
            max_num_seqs=max_batch,
            seed=params.seed,
            # The sampled token's log-prob under the temperature, before top-p (what the trainer recomputes): vLLM's
            # raw log-probs at temperature 1; at another temperature only its processed ones (renormalised after top-p).
            logprobs_mode="raw_logprobs" if params.temperature == 1.0 else "processed_logprobs",
            enable_prefix_caching=True,
            enable_sleep_mode=on_gpu,
            **({"gpu_memory_utilization": 0.5} if on_gpu else {"kv_cache_memory_bytes": kv_cache_bytes}),
        )
        self.sleeping = False

    def load_weights(self, state_dict: dict) -> None:
        """Write the trainer's tensors (Hugging Face names) into vLLM's running model, in place."""
        weights = [(name, torch.as_tensor(t).detach().to(torch.float32)) for name, t in state_dict.items()]
        # The worker's `reload_weights`: the model's layers were repacked for the device after the first load, so
        # their own `load_weights` no longer applies; this restores the checkpoint layout, loads, and repacks.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()  # cached blocks hold the old weights' keys and values

    def export(self, key: Key) -> Request:
        return self.paused.pop(key)

    def generate(self, requests: list[Request], until: int | None = None) -> list[Request]:
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        limit = self.params.max_new_tokens if until is None else min(until, self.params.max_new_tokens)
        results = [request.copy() for request in requests]
        check_fits(results, self.params, self.max_len)
        active = [r for r in results if not r.finished and len(r.tokens) < limit]
        if active:
            seeds = self.segment_seeds(active)
            prompts = [TokensPrompt(prompt_token_ids=r.prompt + r.tokens) for r in active]
            sampling = [
                VllmSampling(
                    n=1,
                    temperature=self.params.temperature,
                    top_p=self.params.top_p,
                    max_tokens=limit - len(r.tokens),
                    stop_token_ids=list(self.params.stop_ids),
                    ignore_eos=True,  # the stop ids are the run's, given above
                    logprobs=0,
                    seed=seed,
                    detokenize=False,
                )
                for r, seed in zip(active, seeds)
            ]
            self.prefill_tokens += sum(len(p["prompt_token_ids"]) for p in prompts)
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
            for request, output in zip(active, outputs):
                self._record(request, output.outputs[0], limit)
        for request in results:
            if request.finished:
                self.paused.pop(request.key, None)
            else:
                self.paused[request.key] = request.copy()
        return results

    def segment_seeds(self, requests: list[Request]) -> list[int]:
        """vLLM's per-request seed of each request's next segment: a hash of (seed, *key) and the tokens it has, so the
        continuation is the same on any engine (vLLM takes a seed below 2^63)."""
        states = key_states(self.params.seed, [r.key for r in requests]).tolist()
        return [(state ^ (len(r.tokens) * 0x9E3779B97F4A7C15)) % (1 << 63) for state, r in zip(states, requests)]

    def _record(self, request: Request, completion, limit: int) -> None:
        """Append vLLM's tokens and their log-probs; the request ends at a stop id, the budget, or `stop`."""
        for token, entry in zip(completion.token_ids, completion.logprobs):
            request.tokens.append(int(token))
            request.log_probs.append(float(entry[token].logprob))
            if (
                token in self.params.stop_ids
                or len(request.tokens) >= self.params.max_new_tokens
                or (self.stop is not None and self.stop(request.tokens))
            ):
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
