"""The tiny target's tokenizer: byte-level BPE with Kimi's pre-tokenizer, special tokens and chat template.

Owns: training the BPE on conversation text (the caller passes the train split
only) and wrapping it as a `transformers` fast tokenizer that saves with
`save_pretrained` and loads back with `AutoTokenizer.from_pretrained` offline,
`apply_chat_template` included. The template and token names come from
`eagle3_dagster.chat.kimi`.

Like Kimi's tiktoken tokenizer: no BOS is added when encoding, every special
marker is one id (and is recognised inside text, as Kimi's
`allowed_special="all"` does), and text is split with Kimi's `pat_str`
before the byte-level merges. Unlike Kimi, the special ids come first in the
vocabulary (what the `tokenizers` trainer does); nothing may rely on id values.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from eagle3_dagster.chat import kimi

# Kimi's pre-tokenizer regex (tokenization_kimi.py `pat_str`); the `&&` class
# intersections are supported by the Oniguruma engine behind `tokenizers.Regex`.
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Words a rendered conversation always contains besides message text (role names).
_TEMPLATE_WORDS = "system user assistant tool tool_declare ## Return of functions."


def conversation_texts(conversations: Iterable) -> Iterator[str]:
    """What the BPE learns from: every message text plus the template's own words."""
    yield _TEMPLATE_WORDS
    for conv in conversations:
        messages = conv.messages if hasattr(conv, "messages") else conv
        for m in messages:
            if isinstance(m.get("content"), str):
                yield m["content"]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE whose vocabulary (special tokens included) has at most `vocab_size` entries.

    Deterministic for the same texts in the same order.
    """
    if vocab_size < 256 + len(kimi.SPECIAL_TOKENS) + 1:
        raise ValueError(
            f"vocab_size {vocab_size} leaves no room for merges (256 bytes + {len(kimi.SPECIAL_TOKENS)} specials)"
        )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(kimi.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(bpe)


def wrap_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    named = {kimi.BOS, kimi.EOS, kimi.PAD, kimi.UNK}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=kimi.BOS,
        eos_token=kimi.EOS,
        pad_token=kimi.PAD,
        unk_token=kimi.UNK,
        extra_special_tokens=[t for t in kimi.SPECIAL_TOKENS if t not in named],
        chat_template=kimi.CHAT_TEMPLATE,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    for t in kimi.SPECIAL_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise AssertionError(f"special token {t!r} encodes to {ids}, expected one id")
    return tok


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """`save_pretrained` writes tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    tok.save_pretrained(str(out_dir))
