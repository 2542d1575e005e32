"""Create a tiny randomly initialised Llama for the integration tier (run by the vLLM venv's python).

``python make_tiny_model.py OUT_DIR``: a byte-level BPE tokenizer trained here on generated text
(no hub access) and a ``LlamaForCausalLM`` with hidden 128, 4 attention heads of 32 (vLLM's CPU
attention rejects head size 16), 2 KV heads, 2 layers, saved with ``save_pretrained`` in float32.
Deterministic: the same seed gives the same weights.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

VOCAB = 1000
MAX_POSITIONS = 2048


def corpus(n_lines: int = 6000) -> list[str]:
    """Generated text to train the tokenizer on (seeded): common English words mixed with
    made-up words of 1-4 syllables, enough distinct pairs for ~1000 BPE merges."""
    rng = random.Random(0)
    common = (
        "the a of to and in is it that for on with as was at by be this from or have an not are "
        "cache block token memory engine request model server queue batch prefill decode kv gpu"
    ).split()
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    made_up = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words = common + made_up
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) for _ in range(n_lines)]


def main(out: Path) -> None:
    """Write tokenizer and model files into ``out``."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    special = ["<s>", "</s>", "<unk>", "<pad>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus(), vocab_size=VOCAB, min_frequency=1, special_tokens=special)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    print(f"tiny model: {sum(p.numel() for p in model.parameters())} parameters, vocab {len(tok)} -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
