"""Evaluations run on the real engine. `kvserve eval perplexity` (kvserve/eval/cli.py) and the
Python API:

    from kvserve import LLM
    from kvserve.eval import perplexity
    result = perplexity(LLM(), open("wiki.test.raw").read(), ctx=512)
    print(result.ppl, result.stderr)
"""

from __future__ import annotations

from kvserve.eval.perplexity import PerplexityResult, perplexity, perplexity_of_tokens

__all__ = ["PerplexityResult", "perplexity", "perplexity_of_tokens"]
