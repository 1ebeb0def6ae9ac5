"""A vLLM rollout engine in its own process and environment, driven by a plancc trainer.

    <vLLM env>/bin/python -m plancc_vllm.server   (started by ``plancc.engine.vllm_rollout``)

It connects back to the trainer's listener (``PLANCC_VLLM_ADDRESS``, ``PLANCC_VLLM_AUTHKEY``:
``multiprocessing.connection``; stdout stays vLLM's log), starts ``vllm.LLM`` with the
``plancc_gloo`` weight-transfer backend, and serves requests one at a time, each a dict with an
``op``, each answered ``{"ok": True, "result": ...}`` or ``{"ok": False, "error": ...}``:

- ``generate``: prompts (token ids) sampled ``n`` times; each completion's tokens and the
  log-probability vLLM gave each sampled token (its raw log-softmax, before any temperature);
- ``init_transfer``, ``update`` (start, the chunks, finish with the version: vLLM's protocol),
  ``version``, ``describe`` (the served model's config, for the trainer's check), ``shutdown``.

A refit that fails part-way leaves some weights new and some old: the server then says so
(``serving`` names the failed version) and refuses to sample until a refit completes.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Client
from typing import Any


def _generate(llm: Any, request: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        n=request.get("n", 1),
        max_tokens=request["max_tokens"],
        temperature=request.get("temperature", 1.0),
        top_p=request.get("top_p", 1.0),
        seed=request.get("seed"),
        logprobs=0,
        detokenize=False,
        ignore_eos=request.get("ignore_eos", False),
    )
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
    out = []
    for i, result in enumerate(llm.generate(prompts, params, use_tqdm=False)):
        for completion in result.outputs:
            ids = list(completion.token_ids)
            logprobs = [entry[token].logprob for token, entry in zip(ids, completion.logprobs or [], strict=True)]
            out.append({"prompt": i, "token_ids": ids, "logprobs": logprobs})
    return out


def _worker_errors(stats_dir: str, workers: int) -> list[str]:
    """The errors the workers kept in this refit (``plancc_vllm.engine``: they never raise)."""
    errors = []
    for rank in range(1, workers + 1):
        with open(os.path.join(stats_dir, f"worker{rank}.json")) as f:
            error = json.load(f).get("error")
        if error:
            errors.append(f"worker {rank}: {error}")
    return errors


def main() -> None:
    host, port = os.environ["PLANCC_VLLM_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["PLANCC_VLLM_AUTHKEY"]))
    spec = conn.recv()
    start = time.perf_counter()
    try:
        from vllm import LLM

        llm = LLM(**spec["llm"], weight_transfer_config={"backend": "plancc_gloo"})
    except Exception as error:  # the trainer names it; nothing was served
        conn.send({"ok": False, "error": f"vLLM did not start: {type(error).__name__}: {error}"})
        raise
    conn.send({"ok": True, "result": {"start_s": time.perf_counter() - start}})
    serving: str | None = None  # None: the weights vLLM loaded at start
    broken: str | None = None  # a refit that failed part-way: its version
    while True:
        request = conn.recv()
        op = request["op"]
        try:
            result: Any = None
            if op == "shutdown":
                conn.send({"ok": True, "result": None})
                break
            if op == "generate":
                if broken is not None:
                    raise RuntimeError(
                        f"the refit to version {broken!r} failed part-way: the weights are a mix of it and "
                        f"{serving!r}; refit again before sampling"
                    )
                result = _generate(llm, request)
            elif op == "init_transfer":
                llm.init_weight_transfer_engine({"init_info": request["init_info"]})
            elif op == "update":
                version = request["version"]
                try:
                    llm.start_weight_update()
                    llm.update_weights({"update_info": request["update_info"]})
                    llm.finish_weight_update()
                    failed = _worker_errors(request["stats_dir"], len(request["update_info"]))
                    if failed:
                        raise RuntimeError(f"vLLM's workers failed the refit: {failed}")
                except BaseException:
                    broken = version
                    raise
                llm.update_weight_version(version)
                serving, broken = version, None
                result = {"version": llm.get_weight_version()}
            elif op == "version":
                result = {"serving": serving, "broken": broken, "vllm": llm.get_weight_version()}
            elif op == "describe":
                config = llm.llm_engine.model_config.hf_config
                result = {"config": config.to_dict(), "dtype": str(llm.llm_engine.model_config.dtype)}
            else:
                raise ValueError(f"unknown op {op!r}")
            conn.send({"ok": True, "result": result})
        except Exception as error:
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            conn.send({"ok": False, "error": f"{type(error).__name__}: {error}"})


if __name__ == "__main__":
    main()
