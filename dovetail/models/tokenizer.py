"""A character-level tokenizer of our own: one token per character of a fixed alphabet.

The synthetic tasks write digits, a few operators and short keywords, so characters are the natural unit:
no merges to learn, no files to download, and a completion's length in tokens is its length in characters.
"""

import json
from collections.abc import Iterable
from pathlib import Path

from dovetail.files import read_text

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
DEFAULT_ALPHABET = "0123456789+-*/=()<>,.:; abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """Ids 0, 1, 2 are pad, bos and eos; the alphabet's characters follow in order."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet {alphabet!r} repeats a character")
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id = range(len(SPECIAL_TOKENS))
        self._ids = {char: len(SPECIAL_TOKENS) + i for i, char in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({char for char in text if char not in self._ids})
        if unknown:
            raise ValueError(f"text {text!r} has characters {unknown} outside the alphabet {self.alphabet!r}")
        return [self._ids[char] for char in text]

    def prompt_ids(self, prompt: str) -> list[int]:
        """A prompt as the model reads it: beginning of sequence, then its characters."""
        return [self.bos_id, *self.encode(prompt)]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def decode(self, ids: Iterable[int]) -> str:
        """The characters of ids, skipping pad, bos and eos wherever they are (the caller decides where to stop)."""
        first = len(SPECIAL_TOKENS)
        return "".join(self.alphabet[i - first] for i in map(int, ids) if i >= first)

    def save(self, directory: Path | str) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.json").write_text(json.dumps({"alphabet": self.alphabet}, indent=2))

    def to_transformers(self):
        """The same tokenizer as a transformers `PreTrainedTokenizerFast` (one token per character, bos first, the
        special tokens skipped when decoding): what `dovetail export` writes beside a built-in model, so that
        `AutoTokenizer.from_pretrained` reads what the model learned."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)} | {char: i for char, i in self._ids.items()}
        pad, bos, eos = SPECIAL_TOKENS
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, self.bos_id)]
        )
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=pad)

    @classmethod
    def load(cls, directory: Path | str) -> "CharTokenizer":
        """The tokenizer `save` wrote into `directory`; any other tokenizer.json is a ValueError naming it."""
        path = Path(directory) / "tokenizer.json"
        expected = '{"alphabet": "<characters, each once>"}, as `dovetail pretrain` writes it'
        text = read_text(path, f"a file holding {expected}")
        try:
            loaded = json.loads(text)
        except ValueError:
            loaded = None
        alphabet = loaded.get("alphabet") if isinstance(loaded, dict) else None
        if not isinstance(alphabet, str) or not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"{path} is not a tokenizer: give the one saved with the model, holding {expected}")
        return cls(alphabet)
