"""Speculative decoding: proposers guess draft tokens, the target verifies them in its next
step, and rejection sampling (sample/rejection.py) keeps exactly the target's distribution.

    registry.py     build_proposer: speculative_config.method -> its proposer
    base.py         the Proposer protocol and SpecStats (vLLM's spec_decode counters)
    ngram.py        prompt lookup over the request's own tokens
    suffix.py       suffix decoding: the longest match in the request's own tokens and in
                    its tenant's past outputs, the most frequent continuation
    respace.py      the prompt with its wrapped lines joined: a second text both lookups
                    read (a rewrite of hard-wrapped text writes a paragraph as one line)
    draft_model.py  a smaller model with the target's vocabulary, its own paged KV cache
                    addressed by the target's block ids
    medusa.py       Medusa heads on the target's last hidden state (Medusa's checkpoint
                    format); medusa_train.py: kvserve train-medusa, by self-distillation
    policy.py       how many drafts (0..K) each request verifies per step: acceptance per
                    request against the measured cost of a row and of a draft token

A step's life:  proposer.propose -> request.spec_token_ids -> Scheduler schedules 1 + k
tokens -> ModelRunner: k + 1 sampling rows -> Sampler.verify -> Scheduler rolls back the
rejected drafts (num_computed_tokens -= rejected).
"""
