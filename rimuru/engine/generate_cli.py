"""`rimuru generate MODEL --prompt ...`: the offline API from the shell, same flags as `LLM`."""

from __future__ import annotations

import argparse
import json
import logging

from rimuru.config import EngineConfig, add_engine_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts (offline)")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--min-tokens", type=int, default=0, help="EOS and stop ids cannot end a reply before this many")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rimuru.engine.llm import LLM
    from rimuru.engine.sampling_params import SamplingParams
    from rimuru.engine.setup import start_or_exit

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig.from_cli_args(args)
    llm = start_or_exit(lambda: LLM(**vars(config)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos,
                            min_tokens=args.min_tokens)
    for out in llm.generate(args.prompt, params):
        comp = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": comp.text, "token_ids": comp.token_ids,
                              "finish_reason": comp.finish_reason}))
        else:
            print(f"--- {out.prompt!r}\n{comp.text}\n[{comp.finish_reason}, {len(comp.token_ids)} tokens]")
    print(json.dumps(llm.stats()))
    return 0
