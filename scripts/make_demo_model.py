#!/usr/bin/env python3
"""Write an offline, weight-less model directory with the Qwen2.5-7B architecture.

Usage: python scripts/make_demo_model.py OUT_DIR [--seed 0]

The directory holds ``config.json`` (Qwen2ForCausalLM, hidden 3584, 28 layers,
28 q heads / 4 KV heads, head_dim 128, intermediate 18944, vocab 152064, bf16),
``generation_config.json`` and a byte-level BPE tokenizer (``tokenizer.json`` +
``tokenizer_config.json``) built offline with the ``tokenizers`` library.  The
tokenizer has exactly 152,064 ids: 152,042 multi-character byte-level BPE tokens
(English-like words with and without a leading space, capitalised words,
numbers, punctuation runs, CJK characters) plus the 22 Qwen2.5 special tokens
at their Qwen ids (151643..151664), so vLLM's detokenizer costs about what it
does with the real tokenizer.  No weights are written: serve it with
``--load-format dummy``.  Nothing is downloaded.

``build_tokenizer`` / ``write_tokenizer`` are reused by ``make_tiny_model.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Dict, List, Tuple

VOCAB_SIZE = 152064

# Qwen2.5 special tokens and their ids (151643 ..= 151664).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]
FIRST_SPECIAL_ID = 151643
EOS_TOKEN_ID = 151643  # <|endoftext|>, as in the Qwen2.5 base models

QWEN25_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "bos_token_id": EOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": VOCAB_SIZE,
}

# Minimal ChatML template (Qwen style) so chat endpoints work offline.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_to_unicode() -> Dict[int, str]:
    """The reversible byte -> printable unicode char table of byte-level BPE.

    Printable latin-1 bytes map to themselves; the other 68 bytes are mapped,
    in increasing order, to code points 256, 257, ... (so space -> 'Ġ').
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: Dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
# Rough English letter frequencies (percent) for the letters above.
_LETTER_W = [12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4,
             2.4, 2.2, 2.0, 2.0, 1.9, 1.5, 1.0, 0.8, 0.15, 0.15, 0.1, 0.07]
_PUNCT = list(".,;:!?-_()[]{}<>\"'/\\*=+#%&@$|~`^")


def _regular_tokens(n: int, seed: int) -> Tuple[List[str], List[Tuple[str, str]]]:
    """``n`` distinct byte-level BPE tokens (256 single bytes first) and merges.

    Every multi-character token is ``parent + last`` where both are earlier
    tokens, and the merge ``(parent, last)`` is recorded, so the BPE model is
    consistent and every id decodes.
    """
    b2u = byte_to_unicode()
    space = b2u[ord(" ")]
    newline = b2u[ord("\n")]
    rng = random.Random(seed)
    tokens: List[str] = [b2u[b] for b in range(256)]
    seen = set(tokens)
    merges: List[Tuple[str, str]] = []
    by_len: Dict[int, List[str]] = {1: []}

    def add(parent: str, last: str) -> bool:
        tok = parent + last
        if tok in seen:
            return False
        seen.add(tok)
        tokens.append(tok)
        merges.append((parent, last))
        word = tok[1:] if tok[0] == space else tok
        if word.isascii() and word.isalpha():  # only word-like tokens keep growing
            by_len.setdefault(len(tok), []).append(tok)
        return True

    # CJK: ~3000 common-range ideographs (3 UTF-8 bytes each -> 2 merges each).
    cjk_target = min(6000, max(0, (n - 256) // 25))
    cp = 0x4E00
    while len(tokens) - 256 < cjk_target and cp < 0x9FFF:
        u = [b2u[x] for x in chr(cp).encode("utf-8")]
        add(u[0], u[1])
        add(u[0] + u[1], u[2])
        cp += rng.randint(1, 3)

    # Seeds of words: letters, ' ' + letter, capitalised forms, digits, punctuation runs,
    # indentation (runs of spaces) and newlines.
    for c in _LETTERS:
        add(space, c)
        add(space, c.upper())
    run = space
    for _ in range(15):
        if not add(run, space):
            break
        run = run + space
    add(newline, newline)
    for d in "0123456789":
        for e in "0123456789":
            add(d, e)
    for p in _PUNCT:
        for q in _PUNCT[:12]:
            add(p, q)
        add(space, p)

    # Target length distribution (chars) of word-like tokens, mean ~6.5.
    lengths = list(range(2, 16))
    len_w = [5, 9, 12, 13, 13, 12, 10, 8, 6, 4, 3, 2, 1.5, 1]
    starters = {1: [c for c in _LETTERS] + [c.upper() for c in _LETTERS]}
    while len(tokens) < n:
        target = rng.choices(lengths, len_w)[0]
        pool = by_len.get(target - 1) if target > 2 else None
        if target == 2 or not pool:
            parent = rng.choice(starters[1] + [space + c for c in _LETTERS])
        else:
            parent = pool[rng.randrange(len(pool))]
        r = rng.random()
        if r < 0.9:
            last = rng.choices(_LETTERS, _LETTER_W)[0]
        elif r < 0.95:
            last = rng.choice("0123456789")
        else:
            last = rng.choice(_PUNCT)
        add(parent, last)
    return tokens[:n], merges[: n - 256]


def build_tokenizer(seed: int = 0):
    """A ``tokenizers.Tokenizer`` with exactly ``VOCAB_SIZE`` ids (see module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    n_regular = VOCAB_SIZE - len(SPECIAL_TOKENS)
    regular, merges = _regular_tokens(n_regular, seed)
    vocab: Dict[str, int] = {}
    it = iter(regular)
    for i in range(VOCAB_SIZE):
        j = i - FIRST_SPECIAL_ID
        vocab[SPECIAL_TOKENS[j] if 0 <= j < len(SPECIAL_TOKENS) else next(it)] = i
    assert len(vocab) == VOCAB_SIZE
    bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                     continuing_subword_prefix="", end_of_word_suffix="",
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([
        AddedToken(t, special=not t.endswith("tool_call>"), normalized=False)
        for t in SPECIAL_TOKENS
    ])
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError("tokenizer size mismatch")
    for j, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != FIRST_SPECIAL_ID + j:
            raise RuntimeError(f"special token {t} has the wrong id")
    return tok


def write_tokenizer(out_dir: str, seed: int = 0, model_max_length: int = 32768) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(seed)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {
        str(FIRST_SPECIAL_ID + j): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": not t.endswith("tool_call>"),
        }
        for j, t in enumerate(SPECIAL_TOKENS)
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def generation_config(eos_token_id: int = EOS_TOKEN_ID) -> dict:
    return {
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": eos_token_id,
        "do_sample": False,
        "max_new_tokens": 2048,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="directory to write (created if missing)")
    ap.add_argument("--seed", type=int, default=0, help="tokenizer vocabulary seed")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    write_json(os.path.join(args.out_dir, "config.json"), QWEN25_7B_CONFIG)
    write_json(os.path.join(args.out_dir, "generation_config.json"), generation_config())
    write_tokenizer(args.out_dir, args.seed, QWEN25_7B_CONFIG["max_position_embeddings"])
    print(f"wrote Qwen2.5-7B-architecture demo model (no weights) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
