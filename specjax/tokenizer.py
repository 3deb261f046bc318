"""Text <-> token ids and chat prompts, from a Hugging Face directory or a GGUF file's metadata.

A directory without tokenizer files, a damaged tokenizer file or generation_config.json, and a
GGUF without (or with unreadable) tokenizer metadata are ValueErrors naming the file.

Building a tokenizer from GGUF metadata goes through transformers' GGUF reader, which imports
torch (about 4 s of a command's start). The tokenizer built is kept in the host cache
(`specjax.host_cache`, folder `tokenizers`) as tokenizer files, under a key of the GGUF file
(resolved path, size, modification time) and the transformers version, and loaded from there
on the next start.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import transformers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from specjax import host_cache

# Files transformers builds a tokenizer from; a directory with none of them has no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
)


class Tokenizer:
    """A thin wrapper over a transformers tokenizer with the few calls the engine needs."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_ids: tuple[int, ...] = ()):
        self.hf = hf_tokenizer
        eos = () if hf_tokenizer.eos_token_id is None else (hf_tokenizer.eos_token_id,)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos + extra_eos_ids))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Tokenizer files of a checkpoint directory; EOS ids also from generation_config.json."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"{path}: not a directory")
        if not any((path / name).is_file() for name in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
            raise ValueError(f"{path}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}, *.tiktoken)")
        generation_config = path / "generation_config.json"
        extra: tuple[int, ...] = ()
        if generation_config.exists():
            try:
                eos = json.loads(generation_config.read_text()).get("eos_token_id")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
                raise ValueError(f"{generation_config}: not a valid JSON object ({exc})") from exc
            extra = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Imported here, not at the top: importing AutoTokenizer imports torch (~3 s).
        from transformers import AutoTokenizer

        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # tokenizers and transformers raise many types (OSError, ValueError, Exception)
            raise ValueError(f"{path}: cannot load its tokenizer ({type(exc).__name__}: {exc})") from exc
        return cls(hf_tokenizer, extra)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer and chat template stored in a GGUF file's metadata (works offline), from
        the host cache when this file's was built before (module doc)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: no such GGUF file")
        cached = _gguf_cache_dir(path)
        if (cached / "tokenizer.json").is_file():
            try:
                return cls(PreTrainedTokenizerFast.from_pretrained(cached))
            except Exception as exc:  # a damaged cache entry is rebuilt from the GGUF file below
                warnings.warn(f"{cached}: cannot load the cached tokenizer ({type(exc).__name__}: {exc}); rebuilding it from {path}")
                shutil.rmtree(cached, ignore_errors=True)
        try:  # The class AutoTokenizer settles on for a llama GGUF, named directly: AutoTokenizer would
            # first rebuild the whole model config with transformers' slow GGUF reader (~5 s) to find it.
            hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
        except KeyError as exc:  # transformers' GGUF tokenizer reader indexes the metadata it needs
            raise ValueError(f"{path}: no tokenizer in its GGUF metadata (missing {exc})") from exc
        except Exception as exc:
            raise ValueError(f"{path}: cannot read the tokenizer from its GGUF metadata ({type(exc).__name__}: {exc})") from exc
        _keep(hf_tokenizer, cached)
        return cls(hf_tokenizer)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids, with the tokenizer's BOS unless the text already starts with it (a rendered chat prompt)."""
        bos = self.hf.bos_token
        already_has_bos = bos is not None and text.startswith(bos)
        return self.hf.encode(text, add_special_tokens=not already_has_bos)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, user_text: str, system: str | None = None) -> str:
        """One user turn rendered with the model's chat template, ending where the assistant speaks."""
        messages = [{"role": "system", "content": system}] if system is not None else []
        return self.render_chat(messages + [{"role": "user", "content": user_text}])

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """A conversation ({role, content} messages) in the model's chat template, ending where the assistant speaks."""
        if not self.hf.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _gguf_cache_dir(path: Path) -> Path:
    """Where the tokenizer of this GGUF file is kept: keyed by the file and the transformers version."""
    stat = path.stat()
    key = host_cache.key(str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), transformers.__version__)
    return host_cache.directory() / "tokenizers" / key


def _keep(hf_tokenizer: PreTrainedTokenizerBase, cached: Path) -> None:
    """Save the tokenizer's files to `cached`, whole or not at all (a warning where it cannot)."""
    try:
        host_cache.publish(cached, hf_tokenizer.save_pretrained)
    except OSError as exc:
        warnings.warn(f"cannot keep the tokenizer in {cached} ({exc}); the next start builds it again")


def load(path: str | Path) -> Tokenizer:
    """Tokenizer for a checkpoint directory or a .gguf file."""
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if path.suffix == ".gguf" and path.is_file():
        return Tokenizer.from_gguf(path)
    raise ValueError(f"{path} is neither a Hugging Face checkpoint directory nor a .gguf file")
