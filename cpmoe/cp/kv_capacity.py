"""How many K/V token slots a request needs on each CP rank, before any cache exists: the owner
rule's arithmetic (where decode tokens go, which rank a split gives each new token), a
request's tokens per rank at its longest, the busiest rank's slots for a batch, and the
one-line refusal of a request that can never fit. Pure functions, shared by the cache, the
scheduler's admission and the CLI's checks."""

from __future__ import annotations


import torch

from cpmoe.cp.split import rank_counts, split_positions


DEFAULT_PAGE_SIZE = 16  # tokens per page (--page-size)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def decode_fill(counts: list[int], new_tokens: int) -> list[int]:
    """Per-rank token counts after `new_tokens` decode tokens are placed by the owner rule
    (one at a time to the rank with the fewest, ties to the lowest rank), in O(cp)."""
    if new_tokens <= 0:
        return list(counts)
    order = sorted(range(len(counts)), key=lambda r: (counts[r], r))
    level, left, i = counts[order[0]], new_tokens, 1
    while i < len(order) and left >= (counts[order[i]] - level) * i:
        left -= (counts[order[i]] - level) * i
        level, i = counts[order[i]], i + 1
    raised = sorted(order[:i])  # these ranks now all hold `level`; the rest in lowest-rank order
    out = list(counts)
    for j, r in enumerate(raised):
        out[r] = level + left // i + (1 if j < left % i else 0)
    return out


def split_owners(tokens: int, cp_size: int, strategy: str, rotation: int) -> bytearray:
    """The CP rank of each of `tokens` new tokens split in one piece with this rotation."""
    out = torch.empty(tokens, dtype=torch.uint8)
    for r, pos in enumerate(split_positions(tokens, cp_size, strategy)):
        out[pos] = (r + rotation) % cp_size
    return bytearray(out.numpy().tobytes())


def request_rank_tokens(prompt_len: int, max_tokens: int, cp_size: int, strategy: str,
                        chunk: int = 0) -> list[int]:
    """Tokens each CP rank stores for one request at its longest: its prompt plus
    max_tokens - 1 decode tokens (the last token is never fed back). Exact for a prompt
    prefilled in one piece (chunk <= 0 or prompt_len <= chunk); for a prompt prefilled in
    chunks an upper bound: a chunk's split gives a rank at most 2 tokens over its even share
    (zigzag: two blocks of q or q + 1; interleave: 1), and chunk boundaries depend on what
    else shares the step's token budget."""
    if chunk <= 0 or prompt_len <= chunk:
        counts = rank_counts(prompt_len, cp_size, strategy)
    else:
        slack = 2 if strategy == "zigzag" else 1
        counts = [-(-prompt_len // cp_size) + slack * -(-prompt_len // chunk)] * cp_size
    return decode_fill(counts, max_tokens - 1)


def kv_slots_needed(prompt_lens: list[int], max_new_tokens: int, cp_size: int,
                    strategy: str, page_size: int = DEFAULT_PAGE_SIZE, chunk: int = 0) -> int:
    """KV token slots (whole pages) the busiest CP rank needs to hold all prompts at their
    longest at once (O(cp) per prompt, whatever max_new_tokens is: admission stays cheap)."""
    pages = [0] * cp_size
    for n in prompt_lens:
        for r, c in enumerate(request_rank_tokens(n, max_new_tokens, cp_size, strategy, chunk)):
            pages[r] += pages_for(c, page_size)
    return max(pages) * page_size


def over_capacity(prompt_len: int, max_new_tokens: int, need: int, capacity: int
                  ) -> str | None:
    """Why one request (`need` = kv_slots_needed of it alone) can never fit a cache of
    `capacity` slots per rank, or None when it fits; callers wrap it in their error type."""
    if need <= capacity:
        return None
    return (f"a prompt of {prompt_len} tokens with {max_new_tokens} new tokens needs {need} "
            f"KV slots on the busiest CP rank, the cache has {capacity} per rank "
            f"(--max-total-tokens {capacity})")
