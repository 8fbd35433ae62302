"""The tokenizer a GGUF file describes in its ``tokenizer.*`` metadata, rebuilt on ``tokenizers``.

``tokenizer.ggml.model`` names one of two kinds:

* ``gpt2``, byte-level BPE (SmolLM, Llama 3, Qwen2): the file lists the merges; the
  pre-tokenizer's split regex comes from ``tokenizer.ggml.pre``.
* ``llama``, SentencePiece (Llama 2, Mistral v0.1-0.3, TinyLlama, Gemma): the file lists the
  pieces with a score and a type each, and no merges.

SentencePiece is rebuilt as a ``tokenizers`` BPE model whose merges are derived from the pieces,
with byte fallback, not as a Unigram model. The vocabularies of this kind were trained as BPE
(SentencePiece ``model_type: BPE``, Gemma's too), and a SentencePiece BPE encoder repeatedly joins
the adjacent pair whose concatenation is the best-scoring piece (llama.cpp's SPM tokenizer does
the same): exactly a BPE merge list holding, for every piece ``ab``, each cut ``(a, b)`` whose
halves are pieces, ranked by the score of ``ab``. A Unigram model over the same scores would pick
the segmentation with the best total score (Viterbi) instead, which differs: these scores are
merge ranks, not log-probabilities. transformers' GGUF reader (the reference the tests compare
ids with) builds the same kind of BPE. The rules:

* merge ranks: user-defined pieces first, by file position (SentencePiece matches them whole
  before merging; Gemma's runs of spaces are user-defined, and ranked first they form before
  the word after them takes their last space), then normal pieces by score, best first, ties by
  file position; of one piece's cuts, the longer left half first. Control, byte, unknown and
  unused pieces are never merge results. transformers ranks Gemma's merges by file position and
  others by score; for Gemma 3 the two orders agree but for the runs of tabs (user-defined, at
  the end of the file), which are matched whole in the text and never reach the merges.
* a whitespace-only piece stored with real spaces (Gemma's ``"   "``) is spelled with ``▁``, as
  the text is once its spaces become ``▁``.
* ``tokenizer.ggml.add_space_prefix`` (default true): ``▁`` is prepended to text that does not
  already start with a space, at the start of the text only (not after a special token), and
  decoding strips that one space again: transformers' non-legacy rule. (llama.cpp also prepends
  it to text that starts with a space, and after special tokens.)
* a character no piece holds is spelled with its UTF-8 bytes' ``<0xNN>`` pieces (the unknown
  piece when the file has none); decoding turns runs of them back into text. The unknown piece
  is special, as in transformers.

For both kinds, control tokens (``<start_of_turn>``, ``<|im_start|>``) are special: matched whole
in text, skipped on request when decoding. User-defined ones (``<think>``, Gemma's ``\\n\\n``) are
matched whole but are ordinary text, as in llama.cpp and transformers. ``add_bos`` / ``add_eos``
become a post-processor, applied when ``encode`` is asked to add special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

_NORMAL, _CONTROL, _USER_DEFINED = int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL), int(
    gguf.TokenType.USER_DEFINED)
_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# Split regexes of llama.cpp pre-tokenizer names (tokenizer.ggml.pre) that differ from GPT-2's.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@dataclass(frozen=True)
class GGUFTokenizerFields:
    """The ``tokenizer.*`` metadata of a GGUF file, already decoded to Python values."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: Sequence[str]
    token_types: Sequence[int]  # a gguf.TokenType per token
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    pre: str | None = None  # tokenizer.ggml.pre
    scores: Sequence[float] = ()  # a score per token (SentencePiece); empty when the file has none
    merges: Sequence[str] = ()  # "left right" (byte-level BPE)
    unk_token_id: int | None = None
    pad_token_id: int | None = None  # read for completeness; no tokenizer step uses it
    add_eos_token: bool = False
    add_space_prefix: bool = True  # SentencePiece: prepend "▁" to the text
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if len(self.token_types) != len(self.tokens) or len(self.scores) not in (0, len(self.tokens)):
            raise ValueError(f"GGUF tokenizer has {len(self.tokens)} tokens but {len(self.token_types)} "
                             f"token types and {len(self.scores)} scores.")
        for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
            token_id = getattr(self, name)
            if token_id is not None and not 0 <= token_id < len(self.tokens):
                raise ValueError(f"GGUF tokenizer's {name} {token_id} is outside its {len(self.tokens)} tokens.")


def tokenizer_fields(reader: gguf.GGUFReader) -> GGUFTokenizerFields:
    """The tokenizer metadata of an open GGUF file; ValueError when it has no tokenizer."""

    def field(name: str) -> Any:
        value = reader.fields.get(f"tokenizer.{name}")
        return None if value is None else value.contents()

    model = field("ggml.model")
    if model is None:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model is missing).")
    tokens = field("ggml.tokens") or []
    eos_ids = [i for i in (field(f"ggml.{k}_token_id") for k in ("eos", "eot", "eom")) if i is not None]
    add_bos, add_space_prefix = field("ggml.add_bos_token"), field("ggml.add_space_prefix")
    return GGUFTokenizerFields(
        model=model,
        pre=field("ggml.pre"),
        tokens=tokens,
        token_types=field("ggml.token_type") or [_NORMAL] * len(tokens),
        scores=field("ggml.scores") or (),
        merges=field("ggml.merges") or (),
        bos_token_id=field("ggml.bos_token_id"),
        eos_token_id=eos_ids[0] if eos_ids else None,
        unk_token_id=field("ggml.unknown_token_id"),
        pad_token_id=field("ggml.padding_token_id"),
        # llama.cpp adds BOS for a SentencePiece vocabulary that does not say otherwise
        add_bos_token=bool(add_bos) if add_bos is not None else model == "llama",
        add_eos_token=bool(field("ggml.add_eos_token")),
        add_space_prefix=bool(add_space_prefix) if add_space_prefix is not None else True,
        chat_template=field("chat_template"),
    )


def gguf_backend(fields: GGUFTokenizerFields) -> BackendTokenizer:
    """The ``tokenizers`` tokenizer ``fields`` describe; ValueError for an unsupported kind."""
    if fields.model == "gpt2":
        backend = _byte_level_backend(fields)
    elif fields.model == "llama":
        backend = _sentencepiece_backend(fields)
    else:
        raise ValueError(
            f"GGUF tokenizer model {fields.model!r} is not supported; byte-level BPE ('gpt2': SmolLM, "
            "Llama 3, Qwen2) and SentencePiece ('llama': Llama 2, Mistral, Gemma) are. Load the model "
            "from its Hugging Face directory (with tokenizer.json) instead.")
    _add_vocabulary_tokens(backend, fields, backend.get_vocab())
    if (processor := _special_tokens_processor(fields)) is not None:
        backend.post_processor = processor
    return backend


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":  # as in SmolLM2's tokenizer.json
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's own split


def _byte_level_backend(fields: GGUFTokenizerFields) -> BackendTokenizer:
    vocab = {token: i for i, token in enumerate(fields.tokens)}
    merges = [(left, right) for left, _, right in (m.partition(" ") for m in fields.merges)]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                          continuing_subword_prefix="", end_of_word_suffix=""))
    if fields.pre in ("qwen2", "deepseek-r1-qwen"):
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _byte_level_pre_tokenizer(fields.pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(fields: GGUFTokenizerFields) -> BackendTokenizer:
    if not fields.scores:
        raise ValueError("GGUF SentencePiece tokenizer has no tokenizer.ggml.scores to rank its merges by.")
    pieces = sentencepiece_pieces(fields.tokens)
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    unk = pieces[fields.unk_token_id] if fields.unk_token_id is not None else None
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=sentencepiece_merges(pieces, fields.scores,
                                                                                   fields.token_types),
                                          unk_token=unk, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if fields.add_space_prefix else "never", split=False)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if fields.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))  # the space the prefix added
    backend.decoder = decoders.Sequence(steps)
    if unk is not None:  # special, as transformers has it: matched whole in text, skipped on request
        backend.add_special_tokens([AddedToken(unk, special=True, normalized=False)])
    return backend


def sentencepiece_pieces(tokens: Sequence[str]) -> list[str]:
    """The tokens as the BPE model sees them: whitespace-only ones stored with real spaces
    (Gemma's runs of spaces) spelled with ``▁``."""
    return [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def sentencepiece_merges(pieces: Sequence[str], scores: Sequence[float],
                         token_types: Sequence[int]) -> list[tuple[str, str]]:
    """Best first: every cut ``(a, b)`` of a normal or user-defined piece ``ab`` whose halves are
    pieces. User-defined pieces rank first (SentencePiece matches them whole), then normal ones by
    score; ties by file position."""
    vocab = set(pieces)
    results = sorted((i for i, kind in enumerate(token_types) if kind in (_NORMAL, _USER_DEFINED)),
                     key=lambda i: (0, 0.0, i) if token_types[i] == _USER_DEFINED else (1, -scores[i], i))
    merges = []
    for i in results:
        piece = pieces[i]
        merges += [(piece[:cut], piece[cut:]) for cut in range(len(piece) - 1, 0, -1)
                   if piece[:cut] in vocab and piece[cut:] in vocab]
    return merges


def _add_vocabulary_tokens(backend: BackendTokenizer, fields: GGUFTokenizerFields, vocab: dict[str, int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (both
    matched whole in raw text), each under its own id. A user-defined token whose spelling the
    model does not hold (a run of spaces spelled with ``▁``) is left to the model."""
    types = list(fields.token_types)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(fields.tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(fields.tokens, types) if k == _USER_DEFINED and t in vocab])


def _special_tokens_processor(fields: GGUFTokenizerFields) -> processors.PostProcessor | None:
    """BOS before and EOS after the text, as the file's add_bos / add_eos ask."""
    bos = fields.bos_token_id if fields.add_bos_token else None
    eos = fields.eos_token_id if fields.add_eos_token else None
    if bos is None and eos is None:
        return None
    head = "" if bos is None else f"{fields.tokens[bos]} "
    tail = "" if eos is None else f" {fields.tokens[eos]}"
    ends = {fields.tokens[i]: i for i in (bos, eos) if i is not None}
    return processors.TemplateProcessing(single=f"{head}$A{tail}", pair=f"{head}$A{tail} {head}$B{tail}",
                                         special_tokens=list(ends.items()))
