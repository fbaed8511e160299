"""Speculative decoding without a draft model: n-gram (prompt-lookup) drafts, verified by the
target model in one step.

    step s:    the engine proposes drafts d1..dk for each decoding request (`ngram`), kept
               on the request (`Request.spec_token_ids`)
               the scheduler gives it 1 + k tokens [t, d1..dk] (fewer drafts when the token
               budget, max_tokens or max_model_len leave less room) and KV slots for them
               the runner computes the chunk as 1 + k decodes sharing the request's block
               table (each token attends to its own causal context: the arithmetic of
               decoding them one by one) and samples every position with the normal
               sampler, as if each draft before it were already output
               (`worker.model_runner`, `accepted`)
               accepted drafts + one token of the model's own are appended; the KV of the
               rejected drafts is past num_computed_tokens, overwritten by later steps

The verification is the rejection rule for a draft from a deterministic proposer (accept
draft x with probability p(x); on rejection draw from p with x removed, renormalised: what
max(p - q, 0) is when q is a point mass at x), realised with the sampler's own draw: at each
position the model's token is drawn exactly as without speculation (the same penalties,
temperature, filters, and for a seeded request the same per-position generator), and the
draft is accepted iff it equals that token. P(accept) = p(x), and a rejection leaves the
draw conditioned on being != x: p with x removed, renormalised. So the output distribution
is exactly the model's, greedy output is the argmax chain, and a seeded request gets the same
tokens with speculation on or off.
"""

from worker.spec_decode.ngram import NgramProposer, accepted

__all__ = ["NgramProposer", "accepted"]
