"""The offline API, shaped like vLLM's:

    from kvserve import LLM, SamplingParams
    llm = LLM(model="smollm2-135m", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kvserve.engine_args import EngineArgs
from kvserve.llm_engine import LLMEngine, PromptType
from kvserve.outputs import RequestOutput
from kvserve.platform import setup_process
from kvserve.sampling_params import SamplingParams
from kvserve.tool_calling.prompt import prompt_messages
from kvserve.tool_calling.support import tool_support

Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        with setup_process(args.device):
            self.llm_engine = LLMEngine.from_engine_args(args)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs come back in the prompts' order."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for i, (rid, prompt, sp) in enumerate(zip(ids, prompts, params)):
                engine.add_request(rid, prompt, sp, priority=priority[i] if priority else 0)
        except Exception:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them. tools:
        OpenAI function tools, rendered as the server renders them (the output is the
        model's text; the server's parsers turn it into tool calls)."""
        convs: list[Messages] = ([messages] if messages and isinstance(messages[0], dict)
                                 else list(messages))  # type: ignore[arg-type]
        tok = self.llm_engine.tokenizer
        support = tool_support(tok, None) if tools else None
        prompts: list[PromptType] = []
        for conv in convs:
            extra: dict[str, Any] = {}
            if support is not None:
                conv, extra = prompt_messages(conv, tools, support.template_renders_tools,
                                              support.parser.call_format)
            prompts.append({"prompt_token_ids": tok.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True, **extra)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
