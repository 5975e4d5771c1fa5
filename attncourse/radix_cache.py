r"""RadixAttention's prefix cache (SGLang): a radix tree over token prefixes whose nodes own KV-cache slots, with
least-recently-used eviction of unreferenced leaves.

vLLM's prefix caching (:mod:`attncourse.prefix_cache`) names each *full page* by a chained hash and looks pages up
one at a time. SGLang (Zheng et al. 2024, "SGLang: Efficient Execution of Structured Language Model Programs",
section 3) keeps every cached sequence in one **radix tree** instead:

* an edge is labelled with a run of token ids, and a node owns the KV slots of its edge's tokens (one slot per
  token: SGLang's default page size is 1), so a path from the root spells a cached prefix and holds its keys and
  values;
* ``match_prefix(tokens)`` walks from the root as far as the tokens agree, splitting an edge where the match stops
  inside it, and returns the slots of the matched prefix: the request's prefill starts after them;
* ``insert(tokens, slots)`` adds a finished (or prefilled) sequence; the part already in the tree is not stored
  twice (the caller frees its own copies of those slots);
* every node carries a **reference count** (``lock_ref``, the running requests whose prefix passes through it)
  and a **last-access time**; when the pool runs out, ``evict`` frees **leaves** with ``lock_ref == 0``, least
  recently used first; a parent left childless and unreferenced becomes a leaf and may go next.

The class manages slot numbers only (0 .. capacity - 1): what the slots hold is the attention kernel's business, as
in SGLang, where ``token_to_kv_pool`` holds the tensors and the tree holds indices into it. Time is a counter
that ticks on every access, so runs are reproducible.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from . import _validate

__all__ = ["RadixCache", "RadixNode", "ServeResult", "shared_prefix_workload"]

POLICIES = ("lru", "fifo", "drop_all")


@dataclass(eq=False)
class RadixNode:
    """A node of the tree: the edge into it (`key`, token ids), the KV slots of those tokens (`value`), its
    children by first token, the running requests that hold it (`lock_ref`), and its last access and creation."""

    key: tuple[int, ...] = ()
    value: list[int] = field(default_factory=list)
    parent: "RadixNode | None" = None
    children: dict[int, "RadixNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    created: int = 0


def _tokens(name: str, tokens) -> tuple[int, ...]:
    if not isinstance(tokens, (list, tuple)) or not all(type(t) is int for t in tokens):
        raise TypeError(f"{name} must be a list or tuple of ints, got {type(tokens).__name__}")
    return tuple(tokens)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixCache:
    """A radix tree of cached token prefixes over a pool of `capacity` KV slots (SGLang's ``RadixCache``).

    ``policy`` chooses what :meth:`evict` frees first among unreferenced leaves: ``"lru"`` (SGLang's default: the
    least recently matched or inserted), ``"fifo"`` (the oldest created), or ``"drop_all"`` (every unreferenced
    leaf at once, the way :meth:`attncourse.prefix_cache.PrefixCache.evict` empties its table). Raises ValueError
    for a capacity below 1 or an unknown policy.
    """

    def __init__(self, capacity: int, policy: str = "lru"):
        _validate.positive_int("capacity", capacity)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.capacity, self.policy = capacity, policy
        self.root = RadixNode(lock_ref=1)  # the root is never evicted
        self.free_slots = list(range(capacity - 1, -1, -1))  # a stack: pop() gives slot 0 first
        self._clock = itertools.count(1)

    # ------------------------------------------------------------------ sizes

    def cached_tokens(self) -> int:
        """Tokens held by the tree (each owns one slot)."""
        return sum(len(n.value) for n in self._nodes())

    def evictable_tokens(self) -> int:
        """Tokens of nodes no running request holds (what eviction could free, leaf by leaf)."""
        return sum(len(n.value) for n in self._nodes() if n.lock_ref == 0)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ lookup and insertion

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node's edge after `at` tokens: a new parent holds the first `at`, `node` keeps the rest."""
        head = RadixNode(node.key[:at], node.value[:at], node.parent, {node.key[at]: node}, node.lock_ref,
                         node.last_access, node.created)
        node.parent.children[node.key[0]] = head
        node.key, node.value, node.parent = node.key[at:], node.value[at:], head
        return head

    def match_prefix(self, tokens) -> tuple[list[int], RadixNode]:
        """The slots of the longest cached prefix of `tokens` and the node where it ends (the root if none).

        Every node on the path is marked as accessed now; an edge the match ends inside is split so that the
        returned node ends exactly at the match. Raises TypeError unless `tokens` is a list/tuple of ints."""
        return self._match(_tokens("tokens", tokens))

    def _match(self, key: tuple[int, ...]) -> tuple[list[int], RadixNode]:
        now = next(self._clock)
        node, slots = self.root, []
        while key and key[0] in node.children:
            child = node.children[key[0]]
            n = _common(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            slots.extend(child.value)
            node, key = child, key[n:]
        return slots, node

    def insert(self, tokens, slots) -> int:
        """Store `tokens` with their KV `slots` (one per token); returns how many leading tokens were already
        cached: the caller still owns those of its `slots` and should free them (:meth:`free`). Raises
        ValueError if the lengths differ, TypeError for non-int ids."""
        key, slots = _tokens("tokens", tokens), list(_tokens("slots", slots))
        if len(key) != len(slots):
            raise ValueError(f"tokens and slots must have the same length, got {len(key)} and {len(slots)}")
        return self._insert(key, slots)

    def _insert(self, key: tuple[int, ...], slots: list[int]) -> int:
        now = next(self._clock)
        node, done = self.root, 0
        while done < len(key) and key[done] in node.children:
            child = node.children[key[done]]
            n = _common(child.key, key[done:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, done = child, done + n
        if done < len(key):
            leaf = RadixNode(key[done:], slots[done:], node, {}, 0, now, now)
            node.children[key[done]] = leaf
        return done

    # ------------------------------------------------------------------ references

    def lock(self, node: RadixNode) -> None:
        """A running request holds the prefix ending at `node`: nothing on its path may be evicted."""
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Release what :meth:`lock` took. Raises ValueError if a node on the path was not locked."""
        path = []
        while node is not None:
            if node.lock_ref <= 0:
                raise ValueError("unlock of a node that no request holds")
            path.append(node)
            node = node.parent
        for n in path:
            n.lock_ref -= 1

    # ------------------------------------------------------------------ slots and eviction

    def free(self, slots) -> None:
        """Give slots the caller owns back to the pool."""
        self.free_slots.extend(_tokens("slots", slots))

    def alloc(self, n: int) -> list[int]:
        """`n` free slots, evicting as needed. Raises MemoryError if even eviction cannot free enough."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if len(self.free_slots) < n:
            self.evict(n - len(self.free_slots))
        if len(self.free_slots) < n:
            raise MemoryError(f"{n} slots asked, {len(self.free_slots)} free after evicting every unreferenced leaf")
        return [self.free_slots.pop() for _ in range(n)]

    def evict(self, n_tokens: int) -> int:
        """Free at least `n_tokens` slots (fewer if not enough is evictable) by deleting unreferenced leaves in the
        policy's order; returns the slots freed. ``"drop_all"`` deletes every unreferenced leaf, repeatedly, once
        any eviction is needed."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
        if n_tokens == 0:
            return 0
        order = (lambda n: n.created) if self.policy == "fifo" else (lambda n: n.last_access)
        tie = itertools.count()
        heap = [(order(n), next(tie), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and (freed < n_tokens or self.policy == "drop_all"):
            _, _, leaf = heapq.heappop(heap)
            self.free_slots.extend(leaf.value)
            freed += len(leaf.value)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (order(parent), next(tie), parent))
        return freed

    # ------------------------------------------------------------------ one request, start to finish

    def serve(self, prompt, n_output: int = 0, output=None) -> int:
        """One request as a serving engine runs it: match the prompt's cached prefix and hold it, take slots for
        the rest of the prompt and the `n_output` generated tokens (evicting if needed), then insert prompt + output
        and release the hold. Returns the prompt tokens whose prefill the cache saved. `output` (the generated ids)
        defaults to tokens no prompt contains (negative ids)."""
        prompt = _tokens("prompt", prompt)
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        output = _tokens("output", output) if output is not None else tuple(-1 - i for i in range(n_output))
        slots, node = self._match(prompt[:-1])  # at least the last prompt token is computed (its logits)
        self.lock(node)
        try:
            new = self.alloc(len(prompt) - len(slots) + len(output))
        finally:
            self.unlock(node)
        seq = prompt + output
        already = self._insert(seq, slots + new)
        self.free_slots.extend(new[:already - len(slots)])  # tokens another request inserted meanwhile: keep the tree's copy
        return len(slots)


@dataclass
class ServeResult:
    """Prompt tokens served from the cache and computed, over a workload."""

    hit_tokens: int
    prompt_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens


def shared_prefix_workload(seed: int, n_requests: int = 400, *, n_system: int = 12, system_len: tuple = (200, 800),
                           question_len: tuple = (20, 120), output_len: tuple = (20, 200), follow_up: float = 0.35,
                           zipf: float = 1.1, vocab: int = 32000) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, output) pairs of a chat service: `n_system` system prompts of Zipf(`zipf`) popularity, each request
    = a system prompt + a fresh question, or (probability `follow_up`) a later turn of an earlier conversation =
    that conversation so far (its prompt and output) + a new question. Token ids drawn from Python's
    ``random.Random(seed)``; lengths uniform in the given ranges."""
    import random

    for name, v in (("n_requests", n_requests), ("n_system", n_system), ("vocab", vocab)):
        _validate.positive_int(name, v)
    rng = random.Random(seed)
    draw = lambda lo_hi: tuple(rng.randrange(vocab) for _ in range(rng.randint(*lo_hi)))  # noqa: E731
    systems = [draw(system_len) for _ in range(n_system)]
    weights = [1 / (i + 1) ** zipf for i in range(n_system)]
    conversations, out = [], []
    for _ in range(n_requests):
        if conversations and rng.random() < follow_up:
            history = rng.choice(conversations)
        else:
            history = rng.choices(systems, weights)[0]
        prompt = history + draw(question_len)
        output = draw(output_len)
        conversations.append(prompt + output)
        out.append((prompt, output))
    return out
