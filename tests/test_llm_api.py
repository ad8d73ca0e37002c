"""The offline API beyond generate: `LLM.chat` (vLLM's, through the tokenizer's chat template) and `LLM.shutdown`
(the engine's memory goes at once, by reference counting: no reference cycle may hold the pool, the model or the
host store, or a second engine on a GPU would find the first one's memory still taken)."""

from __future__ import annotations

import gc
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.testing.tiny_models import CHAT_TEMPLATE, EOS_TOKEN

BUDGET = "64MiB"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)




# ---- chat ------------------------------------------------------------------------------------------------------
def test_chat_renders_the_template_and_generates_as_generate_would(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids(EOS_TOKEN)) == 2  # the template's control tokens stay control tokens

    [out] = llm.chat(messages, GREEDY)
    [ref] = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert out.prompt == text and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.finished


def test_chat_takes_a_batch_of_conversations_and_per_conversation_params(llm: LLM) -> None:
    convs = [[{"role": "user", "content": "Hello"}], [{"role": "user", "content": "How are you today?"}]]
    alone = [llm.chat(c, GREEDY)[0] for c in convs]
    together = llm.chat(convs, [GREEDY, SamplingParams(max_tokens=3, temperature=0.0)])
    assert [o.prompt for o in together] == [o.prompt for o in alone]
    assert together[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert together[1].outputs[0].token_ids == alone[1].outputs[0].token_ids[:3]


def test_chat_template_options(llm: LLM) -> None:
    conv = [{"role": "user", "content": "Hello"}]
    [out] = llm.chat(conv, GREEDY, add_generation_prompt=False)
    assert out.prompt == "<|im_start|>user\nHello<|im_end|>\n"
    [out] = llm.chat(conv, GREEDY, chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                                 "{% endfor %}")
    assert out.prompt == "user: Hello\n"


def test_chat_without_a_tokenizer_or_template_is_a_clear_error(ckpt: Path, tmp_path: Path) -> None:
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for f in ckpt.iterdir():
        if f.name.endswith((".safetensors", "config.json")) and not f.name.startswith("tokenizer"):
            shutil.copy(f, bare / f.name)
    no_tok = LLM(str(bare), gpu_memory_budget=BUDGET, device="cpu")
    assert no_tok.get_tokenizer() is None
    with pytest.raises(ValueError, match="has no tokenizer"):
        no_tok.chat([{"role": "user", "content": "Hello"}])
    no_tok.shutdown()

    plain = LLM(str(ckpt), gpu_memory_budget=BUDGET, device="cpu")
    plain.get_tokenizer().chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        plain.chat([{"role": "user", "content": "Hello"}])
    plain.shutdown()


# ---- shutdown ----------------------------------------------------------------------------------------------------
@pytest.fixture
def no_gc() -> Iterator[None]:
    """No garbage collection while the test runs: what is freed is freed by reference counting alone. Garbage
    from before (one-time imports leave frame cycles) is collected first."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _memory_refs(llm: LLM) -> dict[str, weakref.ref[Any]]:
    """Weak references to the storages behind the engine's memory (a storage lives while any view of it does)."""
    engine = llm.engine
    refs = {"engine": weakref.ref(engine), "pool": weakref.ref(engine.pool.buffer.untyped_storage()),
            "model": weakref.ref(next(engine.model.parameters()).untyped_storage())}
    store = getattr(engine.runtime, "store", None)
    if store is not None:
        refs["host store"] = weakref.ref(store.layers[0].untyped_storage())
    return refs


MODES = [{"offload_mode": "static"}, {"offload_mode": "fixed", "resident_experts": 0.5},
         {"offload_mode": "elastic"}]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m["offload_mode"])
def test_del_frees_the_pool_model_and_host_store_without_the_garbage_collector(ckpt: Path, mode: dict,
                                                                                no_gc: None) -> None:
    llm = LLM(str(ckpt), gpu_memory_budget=BUDGET, device="cpu", **mode)
    llm.engine.enable_step_profiler(2)  # the profiler's callback into the engine must not keep it either
    llm.generate(["Hello", "Hi there"], GREEDY)
    llm.chat([{"role": "user", "content": "Hello"}], GREEDY)
    refs = _memory_refs(llm)
    assert ("host store" in refs) == (mode["offload_mode"] != "static")
    del llm
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still alive after `del llm` without gc: {alive}"


def test_shutdown_frees_the_memory_while_the_llm_is_still_referenced(ckpt: Path, no_gc: None) -> None:
    llm = LLM(str(ckpt), gpu_memory_budget=BUDGET, device="cpu", offload_mode="elastic")
    llm.generate(["Hello"], GREEDY)
    refs = _memory_refs(llm)
    llm.shutdown()
    assert all(ref() is None for ref in refs.values())
    llm.shutdown()  # twice is harmless
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["Hello"], GREEDY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_second_llm_on_the_gpu_gets_the_memory_of_the_first(ckpt: Path) -> None:
    """After `del llm` (no gc.collect()) the first engine's device memory is back with the driver, so the second
    engine's start-up measurement finds it free. The slack covers what outlives an engine by design: kernel images
    and cuBLAS workspaces."""
    slack = 512 * 2**20
    gc.collect()
    torch.cuda.empty_cache()
    allocated0, free0 = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    llm = LLM(str(ckpt), gpu_memory_budget="4GiB", offload_mode="elastic")
    llm.generate(["Hello"], GREEDY)
    assert torch.cuda.memory_allocated() - allocated0 > 2 * slack
    gc.collect()
    gc.disable()
    try:
        del llm
        assert torch.cuda.memory_allocated() - allocated0 < slack
        assert torch.cuda.mem_get_info()[0] > free0 - slack
        second = LLM(str(ckpt), gpu_memory_budget="4GiB", offload_mode="elastic")
        assert second.generate(["Hello"], GREEDY)[0].finished
        second.shutdown()
        assert torch.cuda.memory_allocated() - allocated0 < slack
    finally:
        gc.enable()
