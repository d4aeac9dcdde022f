"""Sampling, split along its seams (each module reads alone):

    processors.py  logit processors as pure functions (bias, masks, penalties, temperature,
                   top-k / top-p, min-p)
    metadata.py    SamplingMetadata: one step's sampling inputs, built from the requests
    logprobs.py    logprob gathering (sampled tokens, prompt tokens)
    rejection.py   exact rejection sampling of draft tokens (speculative decoding)
    sampler.py     Sampler: the processors in order, greedy / inverse-CDF draws, generators;
                   verify() runs rejection.py on a step's draft rows
"""
