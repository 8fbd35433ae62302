"""Write transformers' token ids and decodes of tests/data/tokenizer_sample.txt for a GGUF file.

The tests compare kvserve's GGUF tokenizer with these instead of loading transformers' tokenizer
(about 25 s for Gemma 3's 262k-piece vocabulary on two cores). Run it again when the sample, the
file or the reference changes:

    python scripts/tokenizer_reference.py "$(kvserve models fetch gemma-3-270m)" tests/data/gemma3_tokenizer_reference.json

The texts are the whole sample and each of its sections (split on lines holding ``%%``), with
their ids and decodes; for kvserve/data/botchan.txt (a book, ~60k ids) only the ids' digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from importlib.metadata import version
from pathlib import Path

from kvserve.model.gguf_loader import file_sha256

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "tests" / "data" / "tokenizer_sample.txt"
BOOK = ROOT / "kvserve" / "data" / "botchan.txt"
SECTION_SEPARATOR = "\n%%\n"


def sample_texts() -> list[str]:
    """The whole sample, then its sections. Read as bytes: no newline translation."""
    text = SAMPLE.read_bytes().decode("utf-8")
    return [text, *text.split(SECTION_SEPARATOR)]


def ids_sha256(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(args.gguf.resolve().parent, gguf_file=args.gguf.name)
    texts = []
    for text in sample_texts():
        plain = reference.encode(text, add_special_tokens=False)
        special = reference.encode(text, add_special_tokens=True)
        texts.append({
            "text": text, "ids": plain, "ids_with_special_tokens": special,
            "decode": {"ids": reference.decode(plain, skip_special_tokens=False),
                       "ids_skip_special": reference.decode(plain, skip_special_tokens=True),
                       "ids_with_special_tokens": reference.decode(special, skip_special_tokens=False),
                       "ids_with_special_tokens_skip_special": reference.decode(special, skip_special_tokens=True)},
        })
    book_ids = reference.encode(BOOK.read_bytes().decode("utf-8"), add_special_tokens=False)
    header = {"gguf": args.gguf.name, "gguf_sha256": file_sha256(args.gguf),
              "reference": f"transformers {version('transformers')}, tokenizers {version('tokenizers')}: "
                           "AutoTokenizer.from_pretrained(folder, gguf_file=name)",
              "book": {"num_ids": len(book_ids), "ids_sha256": ids_sha256(book_ids),
                       "decode_sha256": hashlib.sha256(reference.decode(book_ids).encode()).hexdigest()}}
    lines = [json.dumps(t, ensure_ascii=False) for t in texts]   # one text a line: readable diffs
    body = json.dumps(header, ensure_ascii=False, indent=1)[:-2] + ',\n "texts": [\n' + ",\n".join(lines) + "\n]}\n"
    json.loads(body)
    args.out.write_text(body, encoding="utf-8")
    print(f"{args.out}: {len(texts)} texts, {sum(len(t['ids']) for t in texts)} ids")


if __name__ == "__main__":
    main()
