"""A character-level tokenizer built in memory, so tiny models need no downloaded files.

It is a real ``transformers.PreTrainedTokenizerFast`` (backed by a ``tokenizers`` WordLevel
model over single characters), so the sampler, chat templates and ``generate`` treat it
exactly like a hub tokenizer.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ALPHABET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=.,:;?!()'\"\n\\{}^_$#%&<>[]|"

# Minimal chat format: keeps prompts short for tiny models while exercising the chat path.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}{{ message['content'] }}"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def build_char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """Tokenizer with ids ``0..3`` = pad, bos, eos, unk, then one id per character of ``alphabet``."""
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK])}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
