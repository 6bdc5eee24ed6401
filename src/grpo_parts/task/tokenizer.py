"""An offline character-level tokenizer for the built-in task, built with the ``tokenizers`` library.

Every character of :data:`CHARS` is one token; ``<pad>`` (0), ``<eos>`` (1) and ``<unk>`` (2) are
special. The tokenizer ships as a transformers-loadable folder inside the committed warm-start model
(``grpo_parts/assets/tiny_adder/tokenizer.json``), so the built-in run never touches the network and
uses the same loading path as ``--model PATH``.
"""

from __future__ import annotations

from typing import Any

CHARS = "0123456789+-*=,;: "
SPECIALS = ("<pad>", "<eos>", "<unk>")
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


def build_char_tokenizer(chars: str = CHARS) -> Any:
    """A ``tokenizers.Tokenizer`` mapping each character to one id (specials first)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Split into single characters (whitespace included) and glue them back on decode.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def build_hf_tokenizer(chars: str = CHARS) -> Any:
    """The same tokenizer wrapped as a transformers ``PreTrainedTokenizerFast`` (save_pretrained-able)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=build_char_tokenizer(chars),
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
