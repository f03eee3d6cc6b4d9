"""Model rewards from a user's directory and the reward server's client, against independent computations.

The models are tiny and random, built from their configs here and saved with save_pretrained into a temporary
directory: a CLIPModel with its CLIPProcessor (clip_score, pickscore), a Qwen2ForSequenceClassification with one
label and its tokenizer (lm_reward_model). Each reward's scores are checked against upstream's formula computed
here one sample at a time, from the model's own feature methods: torchmetrics' CLIP score max(100 cos, 0),
PickScore's exp(logit_scale) cos, TRL's logits[0, 0] of the unpadded prompt + completion. The reward server is an
http.server in a thread of the test."""

import base64
import io
import json
import socket
import string
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from running import train
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
    CLIPTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from dovetail.config.common import ConfigError
from dovetail.config.load import load_config
from dovetail.models.diffusers_flow import load_flow_model
from dovetail.pipelines.flow.recipe import evaluate
from dovetail.pipelines.lm.local import LMLocal, lm_evaluate
from dovetail.rewards import RewardError, RewardModel, RewardServer, RewardSources, score
from dovetail.rewards.text import score_text

FLOAT32 = {"atol": 1e-5, "rtol": 1e-6}
"""How near a model reward's score is its check's: 1e-5, or a float32's last places on a score in the tens."""

PROMPTS = ["digit 3", "a red cat", "digit 7 on a long line of text", "blue", "digit 0"]
CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789 "


def clip_directory(directory, image_sign: float) -> str:
    """A CLIPModel of width 16 (one layer each side, 16 x 16 images of 8 x 8 patches) and its processor: CLIP's BPE
    over single characters, no merges. Its random embeddings share a direction, so the cosines of its images and
    texts share a sign; `image_sign` -1 negates the image projection, and with it every cosine."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for character in CHARACTERS.strip():
        vocab.setdefault(character, len(vocab))
        vocab.setdefault(character + "</w>", len(vocab))
    directory.mkdir(parents=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=16)
    side = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    text = side | {"vocab_size": len(vocab), "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1}
    vision = side | {"image_size": 16, "patch_size": 8}
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
    with torch.no_grad():
        model.visual_projection.weight.mul_(image_sign)
        model.logit_scale.fill_(2.0)
    model.save_pretrained(directory)
    images = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(directory)
    return str(directory)


CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def reward_model_directory(directory) -> str:
    """A Qwen2ForSequenceClassification (num_labels=1, two layers of width 32) and a tokenizer of one token per
    printable character with a chat template."""
    special = ["<pad>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
    vocabulary = {t: i for i, t in enumerate([*special, *string.printable])}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=special[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    Qwen2ForSequenceClassification(config).save_pretrained(directory)
    fast.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """The CLIP whose cosines are positive (checked where it matters), so that clip_score is 100 cos, not 0."""
    return clip_directory(tmp_path_factory.mktemp("models") / "clip", image_sign=-1.0)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return reward_model_directory(tmp_path_factory.mktemp("models") / "reward-model")


def clip_cosines_one_by_one(directory: str, images: np.ndarray, prompts: list[str]) -> tuple[np.ndarray, float]:
    """cos(image features, text features) of each image and its prompt, computed alone (no padding, no batch; the
    text cut at the model's 16 positions, as upstream's at CLIP's 77), and the model's exp(logit_scale)."""
    model, processor = CLIPModel.from_pretrained(directory).eval(), CLIPProcessor.from_pretrained(directory)
    cosines = []
    for image, prompt in zip(images, prompts, strict=True):
        pixels = Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8)).convert("RGB")
        with torch.no_grad():
            image_features = model.get_image_features(**processor(images=pixels, return_tensors="pt")).pooler_output
            text_features = model.get_text_features(
                **processor(text=prompt, truncation=True, max_length=16, return_tensors="pt")
            ).pooler_output
        cosines.append(float(torch.nn.functional.cosine_similarity(image_features, text_features).item()))
    return np.array(cosines), float(model.logit_scale.detach().exp())


def random_images(seed: int, count: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).random((count, *shape))


@pytest.mark.parametrize("shape", [(8, 8), (20, 12, 3)])
def test_clip_score_and_pickscore_are_upstreams_formulas_batched(clip_dir, shape):
    """Grey and RGB images, in batches of 2 (the last one short, prompts of unequal lengths padded): torchmetrics'
    max(100 cos, 0) and PickScore's exp(logit_scale) cos, and the total their weighted sum with a rule reward."""
    images = random_images(1, len(PROMPTS), shape)
    sources = RewardSources({name: RewardModel(clip_dir, batch_size=2) for name in ("clip_score", "pickscore")})
    weights = {"clip_score": 0.5, "pickscore": -2.0, "brightness": 3.0}
    scores = score(images, PROMPTS, weights, sources=sources)
    cosines, scale = clip_cosines_one_by_one(clip_dir, images, PROMPTS)
    assert scale == pytest.approx(np.exp(2.0), rel=1e-6) and (cosines > 0).all()
    np.testing.assert_allclose(scores["clip_score"], np.maximum(100 * cosines, 0), **FLOAT32)
    np.testing.assert_allclose(scores["pickscore"], scale * cosines, **FLOAT32)
    brightness = images.reshape(len(images), -1).mean(axis=1)
    total = 0.5 * np.maximum(100 * cosines, 0) - 2.0 * scale * cosines + 3.0 * brightness
    np.testing.assert_allclose(scores["total"], total, atol=1e-4, rtol=0)


def test_clip_score_clamps_at_zero(clip_dir, tmp_path):
    """The same CLIP with its image projection negated gives every cosine the other sign: its clip_score is 0 for
    each, where pickscore goes negative with them."""
    negated = clip_directory(tmp_path / "negated", image_sign=1.0)
    images = random_images(2, 6, (8, 8))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(images))]
    names = ("clip_score", "pickscore")
    for directory, sign in ((clip_dir, 1), (negated, -1)):
        sources = RewardSources({name: RewardModel(directory) for name in names})
        scores = score(images, prompts, dict.fromkeys(names, 1.0), sources=sources)
        cosines, scale = clip_cosines_one_by_one(directory, images, prompts)
        assert (np.sign(cosines) == sign).all()
        np.testing.assert_allclose(scores["clip_score"], np.maximum(100 * cosines, 0), **FLOAT32)
        np.testing.assert_allclose(scores["pickscore"], scale * cosines, **FLOAT32)
        assert (scores["clip_score"] == 0).all() == (sign < 0)


def test_lm_reward_model_is_the_last_real_tokens_logit(reward_model_dir):
    """TRL's reward: logits[:, 0] at the last token that is not padding, of prompt + completion (a chat through the
    template); batched and right-padded here, each sequence alone and unpadded in the check."""
    prompts: list = ["sort 3 1 2", "a", [{"role": "user", "content": "say hi"}], "digit 9 please"]
    completions = ["1 2 3", "a much longer answer than the rest", "hi", ""]
    sources = RewardSources({"lm_reward_model": RewardModel(reward_model_dir, batch_size=3)})
    scores = score_text(completions, prompts, {"lm_reward_model": 2.0}, sources=sources)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    texts = [
        p + c if isinstance(p, str) else f"<|user|>{p[0]['content']}<|assistant|>{c}"
        for p, c in zip(prompts, completions)
    ]
    expected = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected.append(model(input_ids=ids).logits[0, 0].item())
    np.testing.assert_allclose(scores["lm_reward_model"], expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(scores["total"], 2.0 * np.array(expected), atol=1e-5, rtol=0)


def test_an_lm_run_scores_its_completions_with_the_reward_model(reward_model_dir):
    """The built-in sort task's model, its rewards the reward model's alone: the evaluation's logged
    reward/lm_reward_model is the mean of logits[0, 0] over the (prompt, completion) pairs it returns, each alone."""
    overrides = ["kind=lm", "reward={lm_reward_model: 1.0}", f"reward_models.lm_reward_model.path={reward_model_dir}"]
    config = load_config(None, [*overrides, "eval.prompts=6"])
    scores, samples = lm_evaluate(LMLocal(config).engines, config)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    expected = []
    for prompt, completion in samples:
        ids = tokenizer(prompt + completion, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected.append(model(input_ids=ids).logits[0, 0].item())
    assert len(samples) == 6 and len({round(e, 6) for e in expected}) > 1
    assert scores["reward/lm_reward_model"] == pytest.approx(float(np.mean(expected)), abs=1e-5)


# ------------------------------------------------------------------------------------------------- the config


def test_a_config_names_model_rewards_with_their_directories(clip_dir, reward_model_dir):
    flow = load_config(None, ["reward={clip_score: 1.0, brightness: 0.1}", f"reward_models.clip_score.path={clip_dir}"])
    assert flow.reward_sources("cpu") == RewardSources({"clip_score": RewardModel(clip_dir)}, None, "cpu")
    lm = load_config(
        None, ["kind=lm", "reward={lm_reward_model: 1.0}", f"reward_models.lm_reward_model.path={reward_model_dir}"]
    )
    assert lm.reward_sources("cpu").models["lm_reward_model"].path == reward_model_dir
    served = load_config(
        None, ["reward={http: 1.0}", "reward_server.url=http://localhost:9/score", "reward_server.retries=1"]
    )
    assert served.reward_sources().server == RewardServer("http://localhost:9/score", retries=1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward={clip_score: 1.0}"], "reward.clip_score loads a model: give reward_models.clip_score.path"),
        (
            ["reward={clip_score: 1.0}", "reward_models.clip_score.path=/no/such/dir"],
            "reward_models.clip_score.path: /no/such/dir is not a directory; save a CLIPModel and its CLIPProcessor",
        ),
        (
            ["reward={pickscore: 1.0}", "reward_models.pickscore.path=REWARD_MODEL"],
            "reward_models.pickscore.path: REWARD_MODEL holds a ['Qwen2ForSequenceClassification'], not a ...CLIPModel",
        ),
        (
            ["reward={brightness: 1.0}", "reward_models.clip_score.path=CLIP_DIR"],
            "reward_models.clip_score: reward.clip_score is not named; add reward.clip_score=1.0 or remove the section",
        ),
        (
            ["reward={brightness: 1.0}", "reward_models.lm_reward_model.path=REWARD_MODEL"],
            "reward_models.lm_reward_model: no model reward of images by that name; those are ['clip_score', "
            "'hps_v2', 'image_reward', 'pickscore']",
        ),
        (
            ["kind=lm", "reward={lm_reward_model: 1.0}", "reward_models.lm_reward_model.path=BARE_REWARD_MODEL"],
            "reward_models.lm_reward_model.path: BARE_REWARD_MODEL has no tokenizer.json or tokenizer_config.json; "
            "save an AutoModelForSequenceClassification and its tokenizer there with save_pretrained",
        ),
        (["reward={http: 1.0}"], "reward.http asks a reward server: give reward_server.url"),
        (["reward_server.url=http://localhost:9"], "reward_server: reward.http is not named"),
        (
            ["reward={http: 1.0}", "reward_server.url=localhost:9"],
            "reward_server.url: 'localhost:9' is no http(s) URL; write it whole, e.g. http://",
        ),
        (
            ["kind=lm", "reward={clip_score: 1.0}"],
            "reward.clip_score scores images; the model rewards of texts are ['lm_reward_model']",
        ),
    ],
)
def test_a_bad_reward_section_is_one_line_naming_the_field_and_the_fix(
    clip_dir, reward_model_dir, overrides, message, tmp_path
):
    bare = tmp_path / "bare"  # the reward model without its tokenizer
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((Path(reward_model_dir) / name).read_bytes())
    paths = {"BARE_REWARD_MODEL": str(bare), "REWARD_MODEL": reward_model_dir, "CLIP_DIR": clip_dir}
    for placeholder, path in paths.items():
        overrides = [o.replace(placeholder, path) for o in overrides]
        message = message.replace(placeholder, path)
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    text = str(error.value)
    assert message in text and "\n" not in text.strip(), text


def test_a_model_that_cannot_load_is_one_line_naming_the_reward_and_the_directory(clip_dir, tmp_path):
    """A directory the config's check passes (config.json, processor, tokenizer) whose weights are broken."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in Path(clip_dir).iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not weights")
    config = load_config(None, ["reward={pickscore: 1.0}", f"reward_models.pickscore.path={broken}"])
    with pytest.raises(RewardError) as error:
        score(random_images(0, 2, (8, 8)), ["a", "b"], config.reward, sources=config.reward_sources("cpu"))
    message = str(error.value)
    assert message.startswith(
        f"reward 'pickscore' could not load a CLIPModel and its CLIPProcessor from {broken} onto cpu: "
    )
    assert "\n" not in message


# ------------------------------------------------------------------------------------------ the reward server


class Server:
    """An http.server in a thread: `answer(request body, attempt)` -> (status, body) for each POST, and
    `requests` what each POST carried, in the order they came."""

    def __init__(self, answer):
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append(body)
                    attempt = len(outer.requests)
                status, answer_body = answer(body, attempt)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(json.dumps(answer_body).encode())
                except OSError:  # the client gave up waiting
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def decoded(png: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(png))))


def pixel_sums(body: dict) -> dict:
    """The server's reward: each image's sum of 8-bit pixels plus its prompt's length."""
    return {"scores": [float(decoded(im).sum()) + len(p) for im, p in zip(body["images"], body["prompts"])]}


def test_the_http_reward_posts_batches_concurrently_and_reads_the_scores():
    """6 images in batches of 2, 2 in flight: the server's barrier of 2 passes only if two arrive together, and its
    count never sees more than 2 at once; the scores come back in the samples' order, weighted."""
    barrier, in_flight, most = threading.Barrier(2, timeout=10), [0], [0]

    def answer(body, attempt):
        with server.lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        barrier.wait()
        with server.lock:
            in_flight[0] -= 1
        return 200, pixel_sums(body)

    images = random_images(3, 8, (5, 4, 3))
    prompts = [f"p{'x' * i}" for i in range(len(images))]
    with Server(answer) as server:
        settings = RewardServer(server.url, concurrency=2, batch_size=2, timeout_s=10)
        scores = score(images, prompts, {"http": 0.5}, sources=RewardSources(server=settings))
    eight_bit = (images * 255).round().astype(np.uint8)
    expected = eight_bit.reshape(len(images), -1).sum(axis=1) + np.array([len(p) for p in prompts])
    np.testing.assert_array_equal(scores["http"], expected)
    np.testing.assert_array_equal(scores["total"], 0.5 * expected)
    assert len(server.requests) == 4 and most[0] == 2
    assert all(decoded(im).shape == (5, 4, 3) for request in server.requests for im in request["images"])


def test_a_request_that_times_out_or_meets_a_busy_server_is_sent_again():
    """The first try waits past timeout_s, the second gets a 503, the third answers: the scores are the third's."""
    release = threading.Event()

    def answer(body, attempt):
        if attempt == 1:
            release.wait(10)
        if attempt == 2:
            return 503, {"error": "busy"}
        return 200, {"scores": [len(c) for c in body["completions"]]}

    with Server(answer) as server:
        settings = RewardServer(server.url, timeout_s=0.3, retries=2, backoff_s=0.01)
        try:
            scores = score_text(["ab", "abcd"], ["q", "q"], {"http": 1.0}, sources=RewardSources(server=settings))
        finally:
            release.set()
    np.testing.assert_array_equal(scores["http"], [2, 4])
    assert [r["completions"] for r in server.requests] == [["ab", "abcd"]] * 3


def test_a_server_that_is_down_is_one_line_naming_the_url():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{free.getsockname()[1]}/score"
    settings = RewardServer(url, retries=2, backoff_s=0.01, timeout_s=2)
    with pytest.raises(RewardError) as error:
        score(random_images(0, 2, (4, 4)), ["a", "b"], {"http": 1.0}, sources=RewardSources(server=settings))
    message = str(error.value)
    assert message.startswith(f"reward server {url} could not be reached (") and "\n" not in message
    assert message.endswith(
        "3 tries; check that it runs and answers there (reward_server.url), or raise reward_server.timeout_s / retries"
    )


def test_a_refused_request_is_not_sent_again_and_says_what_the_server_said():
    with Server(lambda body, attempt: (422, {"detail": "images must be 512 px"})) as server:
        settings = RewardServer(server.url, retries=3, backoff_s=0.01)
        with pytest.raises(RewardError) as error:
            score(random_images(0, 2, (4, 4)), ["a", "b"], {"http": 1.0}, sources=RewardSources(server=settings))
    assert str(error.value) == (
        f'reward server {server.url} answered 422 Unprocessable Entity ({{"detail": "images must be 512 px"}}); '
        "check what it expects: docs/rewards.md gives the request"
    )
    assert len(server.requests) == 1


def test_a_server_answer_without_one_score_per_sample_is_refused_in_one_line():
    with Server(lambda body, attempt: (200, {"scores": [1.0]})) as server:
        with pytest.raises(
            RewardError, match=r'must answer \{"scores": \[\.\.\.\]\} with one number for each of the 2'
        ):
            score(
                random_images(0, 2, (4, 4)),
                ["a", "b"],
                {"http": 1.0},
                sources=RewardSources(server=RewardServer(server.url)),
            )


# -------------------------------------------------------------------------------------------------- a flow run


def test_a_flow_run_logs_the_clip_score_of_the_images_it_made(clip_dir, tmp_path):
    """One step of the built-in digits model with reward clip_score on the tiny CLIP: its base evaluation's logged
    reward is the mean of max(100 cos, 0) over the images the evaluation draws (the same held-out seeds, so the same
    images from the same initial model), computed one by one."""
    overrides = ["reward={clip_score: 1.0}", f"reward_models.clip_score.path={clip_dir}"]
    overrides += ["algo.prompts_per_step=2", "algo.group_size=2", "sampling.num_steps=4", "eval.per_prompt=1"]
    config = load_config(None, overrides)
    summary = train(config, tmp_path / "run", steps=1)
    _, images, prompts = evaluate(load_flow_model(config), config)
    cosines, _ = clip_cosines_one_by_one(clip_dir, images, prompts)
    expected = float(np.maximum(100 * cosines, 0).mean())
    assert summary["base_eval_reward"] == pytest.approx(expected, abs=1e-5)
    assert summary["base_eval"]["clip_score"] == pytest.approx(expected, abs=1e-5)
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/clip_score" in step and step["reward/clip_score"] >= 0


def test_on_ray_a_reward_device_scores_with_the_model_as_the_reference_loop_does(clip_dir, local_ray, tmp_path):
    """The same step under digen with a reward device of its own (which loads the CLIP and scores every sample) and
    in the reference loop: the runtime reproduces the reference's samples, so the logged clip_score is the same."""
    overrides = ["reward={clip_score: 1.0}", f"reward_models.clip_score.path={clip_dir}", "cluster.devices=2"]
    overrides += ["algo.prompts_per_step=2", "algo.group_size=2", "sampling.num_steps=4", "eval.every=100"]
    logged = {}
    for name, policy in (("reference", ["policy=reference"]), ("pool", ["policy=digen", "runtime.reward_devices=1"])):
        train(load_config(None, overrides + policy), tmp_path / name, steps=1)
        logged[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["reward/clip_score"]
    events = json.loads((tmp_path / "pool" / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X" and e["cat"] == "score"} == {1}
    assert logged["pool"] == pytest.approx(logged["reference"], abs=1e-5) and logged["reference"] > 0
