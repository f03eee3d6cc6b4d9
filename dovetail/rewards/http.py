"""The `http` reward: a reward server of the user's scores the batches it is POSTed (`reward_server` in a config).

The request, one JSON object per batch of `batch_size` samples:
  images: {"prompts": [str, ...], "images": [base64 PNG, ...]}  (grey or RGB, 8 bits, as the run made them)
  texts:  {"prompts": [str or chat messages, ...], "completions": [str, ...]}
The answer: {"scores": [number, ...]}, one per sample, in order.

At most `concurrency` batches are in flight at once. A batch that times out (`timeout_s`), cannot connect, is cut
off mid-answer, or gets a 5xx or 429 is sent again after backoff_s, then 2 backoff_s, 4 backoff_s..., `retries`
times; then, or at once for any other status or an answer that is not the above, the call fails with a RewardError
of one line naming the URL and what to check. Standard library only."""

import base64
import http.client
import io
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from dovetail.rewards import RewardError, RewardServer

RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses worth asking again: the server is busy or failing for now, not refusing the request."""


def png_base64(image: np.ndarray) -> str:
    """An image in [0, 1], grey (H, W) or RGB (H, W, 3), as base64 of an 8-bit PNG."""
    buffer = io.BytesIO()
    Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def served_reward(server: RewardServer, scores: str) -> Callable:
    """The reward function that asks `server`: of (images, prompts) where `scores` is "images", of (completions,
    prompts) where it is "texts"."""
    if scores == "images":

        def images_reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
            return post_batches(server, {"prompts": list(prompts), "images": [png_base64(im) for im in images]})

        return images_reward

    def texts_reward(completions: Sequence[str], prompts: Sequence) -> np.ndarray:
        return post_batches(server, {"prompts": list(prompts), "completions": list(completions)})

    return texts_reward


def post_batches(server: RewardServer, columns: dict[str, list]) -> np.ndarray:
    """The server's scores of every sample: `columns` (equal lists, one entry per sample) cut into batches, posted
    `server.concurrency` at a time."""
    samples = len(next(iter(columns.values())))
    starts = range(0, samples, server.batch_size)
    batches = [{k: v[s : s + server.batch_size] for k, v in columns.items()} for s in starts]
    with ThreadPoolExecutor(max_workers=server.concurrency) as pool:
        scores = list(pool.map(lambda batch: post_batch(server, batch), batches))
    return np.concatenate(scores) if scores else np.zeros(0)


def post_batch(server: RewardServer, batch: dict[str, list]) -> np.ndarray:
    """One batch's scores, tried 1 + `server.retries` times where the failure may pass (`RETRIED_STATUSES`, a
    timeout, no connection), waiting backoff_s x 2^attempt between tries."""
    body = json.dumps(batch).encode()
    samples = len(batch["prompts"])
    failure = ""
    for attempt in range(server.retries + 1):
        if attempt:
            time.sleep(server.backoff_s * 2 ** (attempt - 1))
        request = urllib.request.Request(server.url, body, {"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=server.timeout_s) as response:
                return scores_of(server, response.read(), samples)
        except urllib.error.HTTPError as error:
            if error.code not in RETRIED_STATUSES:
                detail = " ".join(error.read(200).decode(errors="replace").split())
                raise RewardError(
                    f"reward server {server.url} answered {error.code} {error.reason} ({detail}); check what it "
                    "expects: docs/rewards.md gives the request"
                ) from None
            failure = f"answered {error.code} {error.reason}"
        except TimeoutError:
            failure = f"took longer than reward_server.timeout_s={server.timeout_s:g} s"
        except http.client.HTTPException as error:  # the answer broke off (IncompleteRead, a bad status line)
            failure = f"broke off its answer ({type(error).__name__})"
        except (urllib.error.URLError, ConnectionError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, TimeoutError):
                failure = f"took longer than reward_server.timeout_s={server.timeout_s:g} s"
            else:
                failure = f"could not be reached ({' '.join(str(reason).split())})"
    raise RewardError(
        f"reward server {server.url} {failure}, {server.retries + 1} tries; check that it runs and answers there "
        "(reward_server.url), or raise reward_server.timeout_s / retries"
    )


def scores_of(server: RewardServer, answer: bytes, samples: int) -> np.ndarray:
    """The scores an answer gives: {"scores": [number, ...]} of one per sample, else a RewardError saying so."""
    try:
        scores = np.asarray(json.loads(answer)["scores"], dtype=np.float64)
    except (ValueError, TypeError, KeyError):
        scores = None
    if scores is None or scores.shape != (samples,):
        raise RewardError(
            f'reward server {server.url} answered {answer[:80]!r}; it must answer {{"scores": [...]}} with one '
            f"number for each of the {samples} samples"
        )
    return scores
